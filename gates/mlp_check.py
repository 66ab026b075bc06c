"""The MLP kernel's check (kernels/mlp.py: gate/up GEMM and SiLU-mul fused): the kernel's output against SiLU-mul of
the gate/up GEMM in fp32, with the kernel gate's rule (gates/kernel_check.py): its max error may be at most twice
that of the unfused arithmetic in the kernel's dtype (torch's GEMM rounded to the dtype, SiLU-mul in fp32, as the
engine runs it without the kernel), plus a tiny epsilon. The GPU kernel gate runs it at row counts around
the kernel's tilings (gates/test_mlp.py: test_mlp_kernel_gate), tests/test_mlp_kernel.py through Triton's
interpreter on a CPU."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# row counts around the kernel's tilings: one row, its 16-row and 32-row blocks and one past each
MLP_ROWS = (1, 2, 15, 16, 17, 31, 32)
EPS = 1e-5          # relative to the largest output: fp32's summation-order differences, where both errors are ~0


def mlp_case(rows: int, hidden: int, intermediate: int, dtype, device, seed: int = 0):
    """x [rows, hidden] and a fused [gate; up] weight [2 * intermediate, hidden], scaled as a trained layer's."""
    g = torch.Generator(device=device).manual_seed(seed)     # drawn on the device (gates/kernel_check.make_case)
    x = torch.randn(rows, hidden, generator=g, device=device)
    w = torch.randn(2 * intermediate, hidden, generator=g, device=device) * hidden ** -0.5
    return x.to(dtype), w.to(dtype)


def mlp_kernel_problems(rows: int, hidden: int, intermediate: int, dtype, device, seed: int = 0,
                        **tiling) -> list[str]:
    """[] when the fused kernel is within the rule at this shape, else what is wrong (non-finite output, the errors).
    `tiling`: the kernel's blocks and group_m, where not the engine's (kernels/mlp.py: gate_up_silu). The output
    starts as NaN: a block no program writes is named as non-finite."""
    from kernels import mlp
    x, w = mlp_case(rows, hidden, intermediate, dtype, device, seed)
    out = torch.full((rows, intermediate), float("nan"), device=device, dtype=dtype)
    out = mlp.gate_up_silu(x, w, out, **tiling).float()
    n = intermediate
    gu = x.float() @ w.float().T
    exact = F.silu(gu[:, :n]) * gu[:, n:]
    gu_dt = F.linear(x, w).float()                     # the GEMM in the dtype, as the engine runs it unfused
    unfused = (F.silu(gu_dt[:, :n]) * gu_dt[:, n:]).to(dtype).float()
    label = (f"the fused MLP kernel (kernels/mlp.py) at {rows} rows, hidden {hidden}, intermediate {intermediate}, "
             f"{str(dtype).removeprefix('torch.')}" + "".join(f", {k} {v}" for k, v in tiling.items()))
    if out.shape != exact.shape:
        return [f"{label}: output {tuple(out.shape)}, expected {tuple(exact.shape)}"]
    if not torch.isfinite(out).all():
        return [f"{label}: non-finite output at {torch.nonzero(~torch.isfinite(out))[:4].tolist()}"]
    err, base = (out - exact).abs().max().item(), (unfused - exact).abs().max().item()
    if err > 2 * base + EPS * max(1.0, exact.abs().max().item()):
        where = divmod(int((out - exact).abs().argmax()), n)
        return [f"{label}: wrong values: max error {err:.3g} against the fp32 arithmetic (at row {where[0]}, column "
                f"{where[1]}), more than twice the unfused {str(dtype).removeprefix('torch.')} arithmetic's {base:.3g}"]
    return []


__all__ = ["MLP_ROWS", "mlp_case", "mlp_kernel_problems"]
