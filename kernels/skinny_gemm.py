"""A GEMM for skinny steps, in Triton: a decode step's projections (q/k/v, o, gate/up, down) at a few dozen rows.

Why: at 32 rows the step reads each layer's weights once and does little arithmetic on them, so a projection should
run at the copy rate. cuBLAS's choices for these shapes do not: on the H200 the 1.5B shape's q/k/v and o took 5.7 and
5.4 us a layer for 6.3 and 4.7 MB of weights (about a quarter of the copy rate), and down ran split-K with a reduce
kernel after it (docs/RESULTS.md, the session 13 profile). Here a program computes BLOCK_N output columns of every
row over the whole K: the grid has as many programs as the columns give (N / BLOCK_N), each streams its columns'
weights once, and there is no second kernel.

Which steps: EngineConfig.skinny_gemm (None: on CUDA) sends a projection of at most MAX_ROWS packed positions here
(engine/model.py, `linear`); larger steps (a prompt chunk) stay with cuBLAS, which is at the copy rate or
compute-bound there. Correctness is tested on CPU through Triton's interpreter (tests/test_skinny_gemm.py) and on the
GPU by the kernel gate (gates/test_kernels.py, test_skinny_gemm) and every token gate of the CUDA configurations.
"""
from __future__ import annotations

import torch

MAX_ROWS = 64           # packed positions up to which a projection runs here
SMS = 132               # the H200's multiprocessors: enough column blocks to give each one a program
LAUNCH = {"num_warps": 4, "num_stages": 4}


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Shapes this kernel takes: a 2-d input of at most MAX_ROWS rows with contiguous last dims and K a multiple of
    16 (tl.dot's least)."""
    return (x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.shape[1] % 16 == 0 and x.stride(1) == 1
            and weight.stride(1) == 1 and x.dtype == weight.dtype)


def tiling(m: int, n: int, k: int, sms: int = SMS) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the rows in one block (tl.dot needs 16 at least); the widest column block that
    still gives every multiprocessor a program (else 16: more programs, each streaming fewer weights); K's blocks of
    128 where K allows (else the largest power of two dividing it)."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = next((b for b in (64, 32) if -(-n // b) >= sms), 16)
    block_k = next(b for b in (128, 64, 32, 16) if k % b == 0)
    return block_m, block_n, block_k


def _kernel():
    from .compile_cache import use_compile_cache
    use_compile_cache()
    from .skinny_gemm_kernels import skinny_linear
    return skinny_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           blocks: tuple[int, int, int] | None = None, launch: dict | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K] (M <= MAX_ROWS), weight [N, K]. `blocks`, `launch`: the tiling and
    (num_warps, num_stages), tiling(...) and LAUNCH unless given (the probe sweeps them)."""
    kernel = _kernel()
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"skinny gemm: input of {k} columns, weight of {weight.shape[1]}")
    bm, bn, bk = blocks or tiling(m, n, k, _sms(x.device))
    if k % bk:
        raise ValueError(f"skinny gemm: K={k} is not a multiple of the K block {bk}")
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    kernel[(-(-n // bn), -(-m // bm))](
        x, weight, bias if bias is not None else weight, out, m, n, x.stride(0), weight.stride(0), out.stride(0),
        K=k, HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **(LAUNCH if launch is None else launch))
    return out


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


__all__ = ["LAUNCH", "MAX_ROWS", "linear", "supports", "tiling"]
