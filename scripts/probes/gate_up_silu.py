"""The MLP's gate/up GEMM and SiLU-mul fused in one Triton kernel, against cuBLAS (F.linear) followed by the compiled
SiLU-mul piece, as the engine runs them: the 1.5B shape (hidden 1536, intermediate 8960) at decode-step row counts,
28 calls over 28 layers' own weights inside a CUDA graph, microseconds a layer. Usage:
python -m scripts.probes.gate_up_silu [--rows 1,8,32,64] [--block-m 64,128] [--out FILE.json]

Why (session 31): on the H100 the 32-row pure decode step's gate/up GEMM is cuBLAS's 192x32 tiling, 94 CTAs for 132
multiprocessors: 24.9 us a layer for 55 MB of weights (2.2 TB/s of 3.35), and SiLU-mul a kernel of its own after it.
Measured on an H100 (docs/RESULTS.md): 23.44 us against 26.69 at 32 rows, 1.15-1.17x at 1-16 rows, 0.82x at 64, so
the engine runs the kernel (kernels/mlp.py) up to 32 rows.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.stats import graph_time


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def fused(x, w, blocks, group_m, launch):
    """kernels/mlp.py's kernel at the given tiling, grid grouping and launch (the engine's: kernels.mlp.tiling,
    GROUP_M and LAUNCH)."""
    from kernels.mlp import gate_up_silu
    return gate_up_silu(x, w, blocks=blocks, group_m=group_m, launch=launch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.gate_up_silu", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--intermediate", type=int, default=8960)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--block-m", default="", help="BLOCK_M values (default: the engine's for each row count: 16, "
                    "32 or 64); from 64 on Triton compiles tl.dot to Hopper's wgmma (session 33: a loaded step's 544 "
                    "rows, where cuBLAS's gate/up GEMM and the SiLU-mul kernel after it took 47.5 + 9.2 us a layer)")
    ap.add_argument("--block-n", default="16,32,64")
    ap.add_argument("--block-k", default="64,128,256")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="3,4,5")
    ap.add_argument("--group-m", default="8", help="GROUP_M values: row blocks a program group shares its weight "
                    "tiles over (matters from two row blocks: kernels/mlp_kernels.py)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gate_up_silu: needs a CUDA device", file=sys.stderr)
        return 2
    from engine.layer_kernels import compiled_ops
    silu_mul = compiled_ops()["silu_mul"]
    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    k, n = a.hidden, a.intermediate
    ws = [torch.randn(2 * n, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(a.layers)]
    wbytes = 2 * n * k * 2
    rows, best = [], {}
    print(f"{'rows':>4} {'tiling':>26} {'us/layer':>8} {'GB/s':>6} {'cublas+silu':>11} {'cublas':>7} {'x':>5} "
          f"{'max|diff|':>9}", flush=True)
    for m in ints(a.rows):
        x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
        torch._dynamo.maybe_mark_dynamic(x, 0)
        silu_mul(F.linear(x, ws[0]))            # compiled before any capture

        def run(fn):
            def step():
                out = None
                for w in ws:
                    out = fn(x, w)
                return out
            return step

        base_us, ref = graph_time(run(lambda x_, w_: silu_mul(F.linear(x_, w_))), a.reps, a.layers)
        gemm_us, _ = graph_time(run(F.linear), a.reps, a.layers)
        bms = ints(a.block_m) or [16 if m <= 16 else 32 if m <= 32 else 64]
        for bm, bn, bk, gm, wp, st in itertools.product(bms, ints(a.block_n), ints(a.block_k), ints(a.group_m),
                                                        ints(a.warps), ints(a.stages)):
            if k % bk or (gm != ints(a.group_m)[0] and -(-m // bm) == 1):
                continue            # one row block: every GROUP_M orders the grid alike
            launch = dict(num_warps=wp, num_stages=st)
            label = f"({bm},{bn},{bk}) g{gm} w{wp}s{st}"
            try:
                us, out = graph_time(run(lambda x_, w_: fused(x_, w_, (bm, bn, bk), gm, launch)), a.reps, a.layers)
            except Exception as e:      # a tiling the compiler refuses (shared memory, registers): say so
                print(f"{m:>4} {label:>26}  {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            err = (out - ref).abs().max().item()
            r = dict(rows=m, blocks=(bm, bn, bk), group_m=gm, launch=launch, us=us, base_us=base_us, gemm_us=gemm_us,
                     gbps=wbytes / us / 1e3, max_abs_diff=err)
            rows.append(r)
            if err < 5e-2 and (m not in best or us < best[m]["us"]):
                best[m] = r
            print(f"{m:>4} {label:>26} {us:>8.2f} {r['gbps']:>6.0f} {base_us:>11.2f} {gemm_us:>7.2f} "
                  f"{base_us / us:>5.2f} {err:>9.2e}", flush=True)
    print("fastest per row count, against cuBLAS + the compiled SiLU-mul (us a layer):")
    for m, r in best.items():
        print(f"  {m:>3} rows: {r['blocks']} g{r['group_m']} {r['launch']} {r['us']:.2f} against {r['base_us']:.2f} "
              f"(cuBLAS alone {r['gemm_us']:.2f}): {r['base_us'] / r['us']:.2f}x")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=rows, best={str(m): r for m, r in best.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
