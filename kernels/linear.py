"""A skinny linear layer (x @ w^T + b at a decode step's few rows) as one split-K Triton kernel whose last program
of each output tile adds the splits: for the projections of a pure decode step that cuBLAS runs below the copy rate.

Why: at 32 rows a projection is a read of its weights, and the bandwidth a kernel reaches is the multiprocessors it
keeps busy. cuBLAS runs the 1.5B shape's q/k/v (2048 x 1536, with its bias) and o (1536 x 1536) as 64 and 96
programs for the H100's 132 multiprocessors: 5.3-6.1 us a layer for 4.7-6.3 MB, about a quarter of the copy rate;
and down (1536 x 8960) as split-K with a reduce kernel of its own after it (338 + 51 us of the H100's 2.2 ms step
in session 33). Splitting K gives every multiprocessor a program. Session 32's probe (scripts/probes/splitk_gemm.py)
left the sum of the splits to the consumer: q/k/v's partials 1.33x faster than cuBLAS's GEMM on the H200, but the
norm that summed o's and down's partials cost more than the split saved (0.84x, 0.82x). Here the sum stays in the
same launch: each program stores its fp32 partial and bumps its tile's count; the tile's last program adds the
partials (in split order: the result does not depend on which program came last) and the bias, and writes the
output in the model's dtype. One launch a projection, nothing for the consumer to do.

State: a count a tile (int32, zero between calls: the last program sets it back) and the partials' workspace, one
pair a device, made before a CUDA graph captures a call (`workspace`) and read by every call after. Calls on one
device run one at a time (one stream, as the engine's steps do): two at once would share the counts. A workspace
that grows keeps its old buffers alive, since a captured graph still writes to the ones it was captured with.

In the engine with EngineConfig.linear_kernel "triton" (off by default: on an H200 in session 36 the 32-row pure
decode step took 1.071x as long with it as with cuBLAS, docs/RESULTS.md):
q/k/v, o and down of forwards of at most SKINNY_ROWS positions (engine/model.py: ForwardContext.linear), its
workspace made before capture (engine/layer_kernels.py: warm_linear). scripts/probes/splitk_gemm.py (`--kernel serial`)
times it against cuBLAS in a graph over 28 layers' weights. Checked by the GPU kernel gate (gates/test_linear.py),
on CPU through Triton's interpreter (tests/test_linear_kernel.py) and compiled there to sm_90 PTX."""
from __future__ import annotations

import functools

import torch

MIN_ROWS = 16               # tl.dot needs 16 rows at least: the row block
SKINNY_ROWS = 32            # the most rows a step's q/k/v, o and down run this kernel (EngineConfig.linear_kernel)
KERNELS = ("torch", "triton")   # EngineConfig.linear_kernel's choices: F.linear (cuBLAS), or this kernel
LAUNCH = dict(num_warps=4, num_stages=3)
_WORKSPACE: dict = {}       # device -> (counts int32, partials fp32)
_RETIRED: list = []         # buffers a grown workspace replaced: graphs captured with them still write to them


def why_unavailable(device) -> str | None:
    """Why the kernel cannot run on `device` (None: it can): as the fused MLP kernel's."""
    from .mlp import why_unavailable as triton_unavailable
    return triton_unavailable(device)


def tiling(rows: int, n: int, k: int, programs: int) -> tuple[int, int, int, int]:
    """(splits, BLOCK_M, BLOCK_N, BLOCK_K) that give about `programs` programs (the multiprocessors) for an
    [rows, k] x [k, n] product: 64-column tiles (32 for one row block of at most 16 rows), 128-deep K blocks, and
    as many splits as fill the device, each at least two K blocks."""
    bm = MIN_ROWS if rows <= MIN_ROWS else 32 if rows <= 32 else 64
    bn = 32 if rows <= MIN_ROWS else 64
    bk = min(128, max(16, 1 << (k - 1).bit_length()))
    tiles = -(-rows // bm) * -(-n // bn)
    splits = max(1, min(-(-programs // tiles), k // (2 * bk)))
    return splits, bm, bn, bk


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """The programs a launch fills the device with: its multiprocessors (the interpreter on a CPU: any count)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def workspace(device, tiles: int, floats: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's counts (at least `tiles`, zero) and partials (at least `floats`), grown if too small; growing
    while a CUDA graph captures is refused (a captured call keeps the buffers it was captured with)."""
    device = torch.device(device)
    counts, part = _WORKSPACE.get(device, (None, None))
    if counts is None or counts.numel() < tiles or part.numel() < floats:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"splitk_linear: its workspace on {device} is too small for this call ({tiles} tiles, "
                               f"{floats} floats) and cannot grow while a CUDA graph captures: call it once before "
                               f"the capture")
        if counts is not None:
            _RETIRED.append((counts, part))
        tiles = max(tiles, 0 if counts is None else counts.numel())
        floats = max(floats, 0 if part is None else part.numel())
        counts = torch.zeros(tiles, dtype=torch.int32, device=device)
        part = torch.empty(floats, dtype=torch.float32, device=device)
        _WORKSPACE[device] = (counts, part)
    return counts, part


def splitk_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  splits: int | None = None, blocks: tuple[int, int, int] | None = None,
                  launch: dict | None = None, partials: bool = False, pdl: bool = False,
                  prefetch: int = 0) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias [N]) -> [M, N] in x's dtype. `splits` and `blocks` (BLOCK_M, BLOCK_N, BLOCK_K):
    tiling()'s for the device's multiprocessors unless given (the probes' sweeps: one split is a skinny GEMM over
    the whole K, scripts/probes/skinny_gemm.py); `launch`: LAUNCH unless given. `partials`: return the splits' fp32
    sums [splits, M, N] unadded (a view of the workspace; session 32's probe: scripts/probes/splitk_gemm.py).
    `pdl`: launched with programmatic dependent launch (CUDA, sm_90: kernels/pdl_kernels.py), `prefetch` elements of
    each program's weight rows (at most its split) fetched into L2 before it waits for the kernel before it."""
    from .compile_cache import use_compile_cache
    use_compile_cache()
    from .linear_kernels import splitk_linear as kernel
    from .pdl import pdl_args
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1 or bias is not None and bias.shape != (n,):
        raise ValueError(f"splitk_linear: x {tuple(x.shape)}, weight {tuple(w.shape)} (both with contiguous rows) "
                         f"and bias {None if bias is None else tuple(bias.shape)}: expected [M, K], [N, K] and [N]")
    s, bm, bn, bk = tiling(m, n, k, multiprocessors(x.device))
    if blocks is not None:
        bm, bn, bk = blocks
    s = splits or s
    k_blocks = -(-k // bk)
    k_per = -(-k_blocks // s) * bk              # each split a whole number of K blocks
    s = -(-k // k_per)                          # no split left empty
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    blocks_m, blocks_n = -(-m // bm), -(-n // bn)
    if partials and s == 1:
        raise ValueError("splitk_linear: partials of one split: ask for two or more")
    counts, part = workspace(x.device, blocks_m * blocks_n, s * blocks_m * bm * n)
    kernel[(blocks_n, s, blocks_m)](x, w, w if bias is None else bias, out, part, counts, m, x.stride(0), w.stride(0),
                                    out.stride(0), N=n, K=k, K_PER=k_per, SPLITS=s, BLOCK_M=bm, BLOCK_N=bn,
                                    BLOCK_K=bk, HAS_BIAS=bias is not None, REDUCE=not partials,
                                    PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                    **pdl_args(pdl, min(prefetch, k_per)), **(launch or LAUNCH))
    if partials:
        return part[:s * blocks_m * bm * n].view(s, blocks_m * bm, n)[:, :m]
    return out


__all__ = ["KERNELS", "LAUNCH", "MIN_ROWS", "SKINNY_ROWS", "splitk_linear", "tiling", "why_unavailable", "workspace"]
