"""The MLP's gate/up GEMM and SiLU-mul in one Triton kernel, for steps of few rows (EngineConfig.mlp_kernel).

Why: at the rows of a pure decode step the gate/up GEMM is a read of its weights (55 MB a layer on the 1.5B shape)
that cuBLAS tiles 192 columns wide: 94 programs for the H100's 132 multiprocessors, 24.6 us a layer (2.2 TB/s of
3.35), and SiLU-mul is a kernel of its own after it. Here a program computes 64 columns (32 up to 16 rows) of gate
and of up over the whole K (no split-K: K is the hidden size) and applies SiLU-mul before it stores: one launch a
layer instead of two, half the output written. Measured on an H100 in a CUDA graph over 28 layers' own weights
(scripts/probes/gate_up_silu.py, docs/RESULTS.md): 23.44 us a layer against 26.69 (cuBLAS 24.64 + SiLU-mul) at 32
rows, 1.15-1.17x at 1-16 rows, and 0.82x at 64 rows: so up to FUSED_ROWS rows only, cuBLAS above.

Numerics: gate and up are rounded to the output dtype as the GEMM's output is, and SiLU-mul runs in fp32 as the
compiled piece does; only the products' summation order differs from cuBLAS's (last-bit differences in the model's
dtype, under the token gates' 0.02 rule). fp32 inputs are multiplied in fp32 ("ieee"), as torch's cuBLAS does.

Checked by the GPU kernel gate (gates/test_mlp.py: test_mlp_kernel_gate) against an fp32 reference at row
counts around its tilings, and on CPU through Triton's interpreter (tests/test_mlp_kernel.py). Which kernel each
forward's MLPs took is recorded (engine/model.py: ForwardContext.fuses_mlp) and held against the configuration by
every gate run's dispatch check (gates/dispatch.py)."""
from __future__ import annotations

import torch

FUSED_ROWS = 32         # the most rows a step's MLP runs fused (cuBLAS above: 0.82x at 64 rows on the H100)
KERNELS = ("torch", "triton")   # EngineConfig.mlp_kernel's choices: F.linear + the SiLU-mul piece, or this kernel


def why_unavailable(device) -> str | None:
    """Why the fused kernel cannot run on `device` (None: it can)."""
    if torch.device(device).type != "cuda":
        return "it is a Triton kernel for CUDA devices (the engine runs torch's kernels elsewhere)"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def tiling(rows: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the probe's fastest on the H100 (32 rows: 32 x 64 x 128; 1-16 rows: 16 x 32 x
    128); tl.dot needs 16 rows at least; K's blocks no wider than K."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n = 32 if rows <= 16 else 64
    block_k = min(128, max(16, 1 << (k - 1).bit_length()))
    return block_m, block_n, block_k


GROUP_M = 8     # row blocks a program group shares its weight tiles over (the kernel's grid order says why)
LAUNCH = dict(num_warps=4, num_stages=3)


def gate_up_silu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None,
                 blocks: tuple[int, int, int] | None = None, group_m: int = GROUP_M,
                 launch: dict | None = None, pdl: bool = False, prefetch: int = 0) -> torch.Tensor:
    """silu(x @ w[:N]^T) * (x @ w[N:]^T) for x [M, K] and the fused [gate; up] weight w [2N, K] -> [M, N].
    `blocks` (BLOCK_M, BLOCK_N, BLOCK_K), `group_m` and `launch` (num_warps, num_stages): the engine's (tiling(),
    GROUP_M, LAUNCH) unless given (the probe's sweep, scripts/probes/gate_up_silu.py). `pdl`, `prefetch`: launched
    with programmatic dependent launch, that many elements of each program's weight rows prefetched into L2 before
    it waits (kernels/pdl_kernels.py)."""
    from .compile_cache import use_compile_cache
    use_compile_cache()
    from .mlp_kernels import gate_up_silu as kernel
    from .pdl import pdl_args
    m, k = x.shape
    n = w.shape[0] // 2
    if w.shape[0] % 2 or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"gate_up_silu: x {tuple(x.shape)} and a [2N, K] weight {tuple(w.shape)}, both with "
                         f"contiguous rows")
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    bm, bn, bk = blocks or tiling(m, k)
    programs = -(-m // bm) * (-(-n // bn))
    kernel[(programs,)](x, w, out, m, x.stride(0), w.stride(0), out.stride(0), N=n, K=k, BLOCK_M=bm, BLOCK_N=bn,
                        BLOCK_K=bk, GROUP_M=group_m, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                        **pdl_args(pdl, min(prefetch, k)), **(launch or LAUNCH))
    return out


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The unfused arithmetic in fp32 (the GEMM's output rounded to x's dtype, SiLU-mul in fp32): what the kernel
    must match to within its dtype's rounding."""
    n = w.shape[0] // 2
    gu = (x.float() @ w.float().T).to(x.dtype).float()
    return (torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]).to(x.dtype)


__all__ = ["FUSED_ROWS", "GROUP_M", "KERNELS", "LAUNCH", "gate_up_silu", "reference", "tiling", "why_unavailable"]
