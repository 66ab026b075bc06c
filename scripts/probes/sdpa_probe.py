"""Host cost of one SDPA call per kernel choice when every call has a new shape, as the `torch` backend's calls do
(a step's histories grow by one token a step). Why kernels/torch_backend.py pins the math kernel on CUDA.

    python -m scripts.probes.sdpa_probe [--device cuda] [--calls 200]
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CHOICES = {"default": None, "efficient+math": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
           "math": [SDPBackend.MATH], "cudnn": [SDPBackend.CUDNN_ATTENTION], "explicit": "explicit"}


def explicit_math(q, k, v, mask, scale):
    """SDPA's math kernel written out (as aten's _scaled_dot_product_attention_math computes it: fp32 for fp16 and
    bf16, the keys and values repeated for GQA, sqrt(scale) on each side, the boolean mask added as 0 / -inf, a
    safe softmax): the candidate for the torch backend's CUDA path, checked here bit for bit against the math
    kernel."""
    dt = q.dtype
    if dt in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    rep = q.shape[-3] // k.shape[-3]
    if rep > 1:
        k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    sf = scale ** 0.5
    attn = torch.matmul(q * sf, k.transpose(-2, -1) * sf)
    attn.add_(torch.zeros(mask.shape, dtype=attn.dtype, device=attn.device).masked_fill_(~mask, float("-inf")))
    return torch.matmul(torch.ops.aten._safe_softmax(attn, -1), v).to(dt)


def bitwise(device: str, calls: int = 20) -> list[str]:
    """explicit_math against the math kernel on random tiles (decode and chunk shapes, each dtype, a fully masked
    row): 'equal' or the largest difference."""
    out = []
    g = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for rows, max_q, kv in ((32, 1, 700), (3, 64, 900), (1, 128, 128)):
            worst = 0.0
            for _ in range(calls):
                q = torch.randn(rows, 4, max_q, 64, device=device, dtype=dtype, generator=g)
                k, v = (torch.randn(rows, 2, kv, 64, device=device, dtype=dtype, generator=g) for _ in "kv")
                mask = torch.ones(rows, 1, max_q, kv, dtype=torch.bool, device=device).tril(kv - max_q)
                mask[0, :, 0] = False
                with sdpa_kernel([SDPBackend.MATH]):
                    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
                got = explicit_math(q, k, v, mask, 0.125)
                if not torch.equal(ref.nan_to_num(7.0), got.nan_to_num(7.0)):
                    worst = max(worst, (ref.float() - got.float()).abs().nan_to_num(1e9).max().item())
            out.append(f"{str(dtype).removeprefix('torch.')} rows={rows} max_q={max_q} kv={kv}: "
                       + ("equal" if worst == 0.0 else f"DIFFERENT (max {worst:.3g})"))
    return out


def probe(device: str, calls: int, rows: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 64,
          dtype=torch.float16) -> list[dict]:
    """Mean milliseconds per call (tensors made inside the loop included: the same for every choice) for each kernel
    choice, with one query row (decode) and 64 (a prompt chunk); a choice that cannot run says why."""
    out = []
    for name, kernels in CHOICES.items():
        for max_q in (1, 64):
            try:
                sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
                sync()
                t0 = time.perf_counter()
                for i in range(calls):
                    kv = 100 + i + max_q      # a new shape every call
                    q = torch.randn(rows, heads, max_q, head_dim, device=device, dtype=dtype)
                    k = torch.randn(rows, kv_heads, kv, head_dim, device=device, dtype=dtype)
                    mask = torch.ones(rows, 1, max_q, kv, dtype=torch.bool, device=device).tril(kv - max_q)
                    if kernels == "explicit":
                        explicit_math(q, k, k, mask, head_dim ** -0.5)
                        continue
                    with sdpa_kernel(kernels) if kernels else contextlib.nullcontext():
                        F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
                sync()
                out.append(dict(choice=name, max_q=max_q, ms=(time.perf_counter() - t0) / calls * 1e3))
            except RuntimeError as e:
                out.append(dict(choice=name, max_q=max_q, error=str(e).splitlines()[0][:120]))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.sdpa_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__} on {a.device}")
    for line in bitwise(a.device):
        print("explicit vs math:", line)
    for r in probe(a.device, a.calls):
        what = f"{r['ms']:.3f} ms per call" if "ms" in r else f"cannot run: {r['error']}"
        print(f"{r['choice']:16s} max_q={r['max_q']:3d}: {what}")


if __name__ == "__main__":
    main()
