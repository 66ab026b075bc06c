"""The split-K linear kernel's check (kernels/linear.py: x @ w^T + b for a step's few rows, its last program of a
tile adding the splits): the kernel's output against the fp32 arithmetic with the kernel gate's rule
(gates/kernel_check.py): its max error may be at most twice that of torch's F.linear in the kernel's dtype (what the
engine runs without the kernel), plus a tiny epsilon. The GPU kernel gate runs it at row counts around the kernel's
row blocks for each projection it serves (gates/test_linear.py: test_linear_kernel_gate), tests/test_linear_kernel.py
through Triton's interpreter on a CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# row counts around the kernel's row blocks: one row, its 16-row and 32-row blocks and one past each
LINEAR_ROWS = (1, 2, 15, 16, 17, 31, 32)
EPS = 1e-5          # relative to the largest output: fp32's summation-order differences, where both errors are ~0


def linear_case(rows: int, n: int, k: int, bias: bool, dtype, device, seed: int = 0):
    """x [rows, k], a weight [n, k] scaled as a trained layer's, and a bias [n] (or None)."""
    g = torch.Generator(device=device).manual_seed(seed)     # drawn on the device (gates/kernel_check.make_case)
    x = torch.randn(rows, k, generator=g, device=device)
    w = torch.randn(n, k, generator=g, device=device) * k ** -0.5
    b = torch.randn(n, generator=g, device=device) if bias else None
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def linear_problems(x, w, b, label: str = "", **tiling) -> list[str]:
    """[] when the kernel's output on (x, w, b) is within the rule, else what is wrong (non-finite output, the
    errors). The output starts as NaN: a tile no program writes is named as non-finite. `tiling`: the kernel's
    splits, blocks and launch, where not its own (kernels/linear.py: splitk_linear)."""
    from kernels import linear
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    got = linear.splitk_linear(x, w, b, out, **tiling).float()
    exact = x.float() @ w.float().T + (0 if b is None else b.float())
    base = (F.linear(x, w, b).float() - exact).abs().max().item()
    label = (f"the split-K linear kernel (kernels/linear.py) {label or ''}at {tuple(x.shape)} x {tuple(w.shape)}, "
             f"bias {b is not None}, {str(x.dtype).removeprefix('torch.')}"
             + "".join(f", {k} {v}" for k, v in tiling.items()))
    if not torch.isfinite(got).all():
        return [f"{label}: non-finite output at {torch.nonzero(~torch.isfinite(got))[:4].tolist()}"]
    err = (got - exact).abs().max().item()
    if err > 2 * base + EPS * max(1.0, exact.abs().max().item()):
        where = divmod(int((got - exact).abs().argmax()), w.shape[0])
        return [f"{label}: wrong values: max error {err:.3g} against the fp32 arithmetic (at row {where[0]}, column "
                f"{where[1]}), more than twice torch's {str(x.dtype).removeprefix('torch.')} linear's {base:.3g}"]
    return []


def projections(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int) -> list[tuple]:
    """(name, out features, in features, bias) of each projection the kernel serves in a layer: q/k/v as one fused
    weight with its bias, o, down."""
    return [("q/k/v", (heads + 2 * kv_heads) * head_dim, hidden, True), ("o", hidden, heads * head_dim, False),
            ("down", hidden, intermediate, False)]


__all__ = ["LINEAR_ROWS", "linear_case", "linear_problems", "projections"]
