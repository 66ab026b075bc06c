"""A skinny GEMM in Triton against cuBLAS (F.linear) on a GPU: the 1.5B shape's four projections at decode-step row
counts, each as 28 calls over 28 layers' own weights inside a CUDA graph (the weights do not stay in L2 from one call
to the next, as in a step), microseconds a call and the weight bytes' rate; the kernel's own tiling first, then a
sweep of tilings. Usage: python -m scripts.probes.skinny_gemm [--rows 1,8,32,64] [--out FILE.json]

Why: at 32 rows the session 13 profile had q/k/v and o at 5.7 and 5.4 us a layer for 6.3 and 4.7 MB of weights
(about a quarter of the copy rate), and down split-K with a reduce kernel after it. The kernel here computes
BLOCK_N output columns of every row over the whole K (no split-K, no second kernel). Measured on the H200 in
session 16 (docs/RESULTS.md): no faster than cuBLAS for q/k/v and o (5.7-6.3 us against 5.4-6.5), slower for
gate/up; in the engine (behind a configuration switch, in the same call) the 32-row pure decode step took 2.41 ms
of device time with it against 2.02 ms without. So the engine keeps cuBLAS; the probe stays for the next attempt
(split-K with an in-kernel reduction, or a GEMV-style kernel for one to eight rows).
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.stats import graph_time

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 12 query heads and 2 key/value heads of 128
SMS = 132               # the H200's multiprocessors


def tiling(m: int, n: int, k: int, sms: int = SMS) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the rows in one block (tl.dot needs 16 at least); the widest column block that
    still gives every multiprocessor a program (else 16); K's blocks of 128 where K allows."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = next((b for b in (64, 32) if -(-n // b) >= sms), 16)
    block_k = next(b for b in (128, 64, 32, 16) if k % b == 0)
    return block_m, block_n, block_k


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, blocks: tuple[int, int, int],
           launch: dict | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], weight [N, K] at the given tiling: kernels/linear.py's kernel at one
    split (a program per BLOCK_N columns over the whole K; until session 34 a kernel of this probe's own)."""
    from kernels.linear import splitk_linear
    return splitk_linear(x, weight, bias, splits=1, blocks=blocks, launch=launch or {"num_warps": 4, "num_stages": 4})


# (N, K, bias): Qwen2.5-1.5B's q/k/v (fused), o, gate/up (fused) and down projections
SHAPES = {"qkv": (2048, 1536, True), "o": (1536, 1536, False), "gate_up": (17920, 1536, False),
          "down": (1536, 8960, False)}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.skinny_gemm", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sweep-rows", default="32", help="row counts whose tilings are swept")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="64,128,256")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="3,4,6")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("skinny_gemm: needs a CUDA device", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    print(f"{'shape':>8} {'rows':>4} {'tiling':>22} {'us/call':>8} {'GB/s':>6} {'cublas us':>9} {'x':>5} {'max|diff|':>9}")
    for name in a.shapes.split(","):
        n, k, has_bias = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(a.layers)]
        bs = [torch.randn(n, device=dev, dtype=dt, generator=g) if has_bias else None for _ in range(a.layers)]
        wbytes = n * k * 2
        for m in ints(a.rows):
            x = torch.randn(m, k, device=dev, dtype=dt, generator=g)

            def run(fn):
                def step():
                    out = None
                    for w, b in zip(ws, bs):
                        out = fn(x, w, b)
                    return out
                return step

            cub_us, ref = graph_time(run(F.linear), a.reps, a.layers)
            cands = [(tiling(m, n, k), None, True)]
            if m in ints(a.sweep_rows):
                for bn, bk, wp, st in itertools.product(ints(a.block_n), ints(a.block_k), ints(a.warps),
                                                         ints(a.stages)):
                    if k % bk == 0:
                        cands.append(((tiling(m, n, k)[0], bn, bk), dict(num_warps=wp, num_stages=st), False))
            for blocks, launch, own in cands:
                label = f"{blocks}" + ("" if launch is None else f" w{launch['num_warps']}s{launch['num_stages']}")
                try:
                    us, out = graph_time(run(lambda x_, w_, b_: linear(x_, w_, b_, blocks=blocks, launch=launch)),
                                         a.reps, a.layers)
                except Exception as e:      # a tiling the compiler refuses (shared memory, registers): say so
                    print(f"{name:>8} {m:>4} {label:>22}  {type(e).__name__}: {str(e)[:80]}")
                    continue
                err = (out - ref).abs().max().item()
                r = dict(shape=name, rows=m, blocks=blocks, launch=launch, own=own, us=us, cublas_us=cub_us,
                         gbps=wbytes / us / 1e3, max_abs_diff=err)
                rows_out.append(r)
                print(f"{name:>8} {m:>4} {label + (' *' if own else ''):>22} {us:>8.2f} {r['gbps']:>6.0f} "
                      f"{cub_us:>9.2f} {cub_us / us:>5.2f} {err:>9.2e}")
    best = {}
    for r in rows_out:
        key = f"{r['shape']}@{r['rows']}"
        if r["max_abs_diff"] < 5e-2 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    print("fastest per shape and rows (* the kernel's own tiling):")
    for key, r in best.items():
        print(f"  {key}: {r['blocks']} {r['launch']} {r['us']:.2f} us against cuBLAS {r['cublas_us']:.2f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=rows_out, best=best), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
