"""SiLU-and-multiply as one Triton kernel: out[t, j] = silu(gate_up[t, j]) * gate_up[t, width + j] (CUDA only).

Why not torch.compile's kernel: Inductor flattens the [tokens, width] output into one index and takes gate and up
as two strided views of the fused projection's output; on the H200 its kernel ran at 1.2 TB/s at 8192 tokens of the
1.5B shape, against 2.6-3.5 TB/s for the norms compiled the same way (bench/elementwise.py, docs/RESULTS.md). Here
each program reads BLOCK contiguous columns of one token's gate and up and writes BLOCK outputs: no division in
the indexing, every load contiguous. The arithmetic is eager PyTorch's: SiLU in fp32 rounded to the input's dtype,
then one multiply in that dtype.

Triton compiles the kernel at its first call (the engine's warm-up, before any CUDA graph is captured). Under
TRITON_INTERPRET=1 it runs on CPU tensors too, which is how the tests check it without a GPU.
"""
from __future__ import annotations

import torch

BLOCK = 1024


def why_unavailable(device) -> str | None:
    """None if the kernel runs on `device`, else why not."""
    if torch.device(device).type != "cuda":
        return "the Triton SiLU-mul runs on CUDA only"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not importable: {e}"
    return None


_kernel = None


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)       # int64: tokens x 2 x width may pass 2^31 elements
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < width
        gate = tl.load(x_ptr + row * 2 * width + col, mask=mask)
        up = tl.load(x_ptr + row * 2 * width + width + col, mask=mask)
        g = gate.to(tl.float32)
        tl.store(out_ptr + row * width + col, (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up, mask=mask)

    return silu_mul_kernel


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [tokens, 2 * width], contiguous -> [tokens, width]."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul needs a contiguous [tokens, 2 * width] input")
    tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        import triton
        _kernel[(tokens, triton.cdiv(width, BLOCK))](gate_up, out, width, BLOCK=BLOCK)
    return out


__all__ = ["BLOCK", "silu_mul", "why_unavailable"]
