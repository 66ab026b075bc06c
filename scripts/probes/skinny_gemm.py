"""The skinny GEMM (kernels/skinny_gemm.py) against cuBLAS (F.linear) on a GPU: the 1.5B shape's four projections at
decode-step row counts, each as 28 calls over 28 layers' own weights inside a CUDA graph (the weights do not stay in
L2 from one call to the next, as in a step), microseconds a call and the weight bytes' rate; the kernel's own tiling
first, then a sweep of tilings. Usage: python -m scripts.probes.skinny_gemm [--rows 1,8,32,64] [--out FILE.json]"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.stats import graph_time
from kernels import skinny_gemm as sg

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 12 query heads and 2 key/value heads of 128
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
            cands = [(sg.tiling(m, n, k), None, True)]
            if m in ints(a.sweep_rows):
                for bn, bk, wp, st in itertools.product(ints(a.block_n), ints(a.block_k), ints(a.warps),
                                                         ints(a.stages)):
                    if k % bk == 0:
                        cands.append(((sg.tiling(m, n, k)[0], bn, bk), dict(num_warps=wp, num_stages=st), False))
            for blocks, launch, own in cands:
                label = f"{blocks}" + ("" if launch is None else f" w{launch['num_warps']}s{launch['num_stages']}")
                try:
                    us, out = graph_time(run(lambda x_, w_, b_: sg.linear(x_, w_, b_, blocks=blocks, launch=launch)),
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
