"""The skinny GEMM's gate check (gates/test_kernels.py, test_skinny_gemm): a projection at decode-step row counts
against F.linear in fp64, held to the kernel gate's rule (twice the error of F.linear in the kernel's dtype, plus a
tiny epsilon), with NaN in the weight rows and input rows past the shape (a kernel that reads past its
rows or columns returns NaN)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .failure import GateFailure
from .kernel_check import EPS


def projection_shapes(c: dict) -> dict[str, tuple[int, int, bool]]:
    """A model config's (engine.loader.model_config) four projections as (N, K, bias): the fused q/k/v (with its
    bias), o, the fused gate/up, down."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kv_heads, d = c.get("num_key_value_heads") or heads, c.get("head_dim") or hidden // heads
    return {"qkv": ((heads + 2 * kv_heads) * d, hidden, True), "o": (hidden, heads * d, False),
            "gate_up": (2 * c["intermediate_size"], hidden, False), "down": (hidden, c["intermediate_size"], False)}


def check_linear(fn, m: int, n: int, k: int, bias: bool, *, device="cpu", dtype=torch.float16, seed=0,
                 name: str = "") -> dict:
    """fn(x, weight, bias) for x [m, k], weight [n, k] against F.linear in fp64. The operands are views into larger
    buffers whose extra rows hold NaN. Raises GateFailure naming the shape and the error; returns {'err', 'base',
    'tol'} when it passes."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    xs = torch.full((m + 3, k), float("nan"))
    xs[:m] = torch.randn(m, k, generator=g)
    ws = torch.full((n + 5, k), float("nan"))
    ws[:n] = torch.randn(n, k, generator=g) * k ** -0.5
    bs = torch.randn(n + 5, generator=g) if bias else None
    x, w = xs.to(device, dtype)[:m], ws.to(device, dtype)[:n]
    b = bs.to(device, dtype)[:n] if bias else None
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    base = float((F.linear(x, w, b).double() - ref).abs().max())
    tol = 2 * base + EPS
    what = f"skinny gemm {name or ''} [{m} x {k}] @ [{n} x {k}]^T{' + bias' if bias else ''} in {dtype}".replace("  ", " ")
    out = fn(x, w, b)
    if tuple(out.shape) != (m, n):
        raise GateFailure(f"{what}: output shape {tuple(out.shape)}, expected {(m, n)}")
    err_t = (out.double() - ref).abs()
    bad = int((~torch.isfinite(out)).sum())
    err = float(torch.nan_to_num(err_t, nan=float("inf")).max())
    if bad or not err <= tol:
        why = (f"{bad} non-finite outputs of {out.numel()}: it read a row past the input's or the weight's (NaN)"
               if bad else "wrong values")
        flat = int(torch.nan_to_num(err_t, nan=float("inf")).argmax())
        raise GateFailure(f"{what}: max error {err:.3e} vs the fp64 reference exceeds 2 x {base:.3e} (F.linear's "
                          f"error in {dtype}) + {EPS:g} = {tol:.3e}; {why}; worst at row {flat // n}, column "
                          f"{flat % n}")
    return {"err": err, "base": base, "tol": tol}
