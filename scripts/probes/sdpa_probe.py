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
           "math": [SDPBackend.MATH], "cudnn": [SDPBackend.CUDNN_ATTENTION]}


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
    for r in probe(a.device, a.calls):
        what = f"{r['ms']:.3f} ms per call" if "ms" in r else f"cannot run: {r['error']}"
        print(f"{r['choice']:16s} max_q={r['max_q']:3d}: {what}")


if __name__ == "__main__":
    main()
