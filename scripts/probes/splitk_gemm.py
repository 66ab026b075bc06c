"""Split-K skinny GEMMs whose partial sums the consumer adds, against cuBLAS, on a GPU: the 1.5B shape's q/k/v, o
and down projections at decode-step rows, 28 calls over 28 layers' own weights in a CUDA graph. For o and down the
pair that a layer runs is timed: the GEMM and the compiled add + RMSNorm after it (cuBLAS's fp16 output, or the
split-K kernel's fp32 partials summed inside that norm kernel, so no reduce kernel is launched).

Why: at 32 rows cuBLAS runs q/k/v (with its bias) as 64 programs and o as 96 for the 132 multiprocessors, 5.3-5.6 us
a layer for 4.7-6.3 MB (about a quarter of the copy rate), and down as split-K. A split over K gives every
multiprocessor a program; the sum of the splits moves into the kernel that reads the output anyway.

Session 34 added `--kernel serial`: kernels/linear.py's split-K kernel, whose last program of each output tile adds
the splits (and q/k/v's bias) in the same launch and writes the output in the model's dtype, so o and down are
timed with the same compiled add + RMSNorm after them as cuBLAS is; the variant `auto` is the kernel's own tiling.

    python -m scripts.probes.splitk_gemm [--rows 1,8,32] [--kernel partials|serial] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.stats import graph_time
from scripts.probes.skinny_gemm import SHAPES as ALL_SHAPES, ints

SHAPES = {name: ALL_SHAPES[name] for name in ("qkv", "o", "down")}    # gate/up has its fused kernel (kernels/mlp.py)
EPS = 1e-6


def partials(x, w, splits, bn, bk, bm, warps, stages):
    """The splits' fp32 sums [splits, M, N], unadded: kernels/linear.py's kernel stopped before its last program adds
    them (until session 34 a kernel of this probe's own)."""
    from kernels.linear import splitk_linear
    return splitk_linear(x, w, splits=splits, blocks=(bm, bn, bk), launch=dict(num_warps=warps, num_stages=stages),
                         partials=True)


def norm_of(s, weight):
    x = s.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)).to(s.dtype)


def add_norm(o, residual, weight):
    s = o + residual
    return norm_of(s, weight), s


def add_norm_parts(part, residual, weight):
    s = part.sum(0).to(residual.dtype) + residual
    return norm_of(s, weight), s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.splitk_gemm", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--splits", default="2,3,4,6,8")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--block-k", default="64,128")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--stages", default="3,4")
    ap.add_argument("--kernel", default="partials", choices=("partials", "serial"),
                    help="partials: the consumer sums the splits; serial: kernels/linear.py (its last program does)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("splitk_gemm: needs a CUDA device", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    c_add_norm = torch.compile(add_norm, fullgraph=True)
    c_add_norm_parts = torch.compile(add_norm_parts, fullgraph=True)
    results, best = [], {}
    print(f"{'shape':>6} {'rows':>4} {'variant':>26} {'us/layer':>8} {'cuBLAS':>8} {'x':>5} {'max|diff|':>9}")
    for name in a.shapes.split(","):
        n, k, has_bias = SHAPES[name]
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(a.layers)]
        bs = [torch.randn(n, device=dev, dtype=dt, generator=g) * 0.02 if has_bias else None
              for _ in range(a.layers)]
        nw = torch.rand(n, device=dev, dtype=dt, generator=g) + 0.5
        for m in ints(a.rows):
            x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
            res = torch.randn(m, n, device=dev, dtype=dt, generator=g)

            def base_step():
                out = None
                for w, b in zip(ws, bs):
                    out = F.linear(x, w, b)
                    if not has_bias:
                        out = c_add_norm(out, res, nw)[0]
                return out

            base_us, ref = graph_time(base_step, a.reps, a.layers)
            nobias = None
            if has_bias:
                nobias, _ = graph_time(lambda: [F.linear(x, w) for w in ws][-1], a.reps, a.layers)
            variants = list(itertools.product(ints(a.splits), ints(a.block_n), ints(a.block_k), ints(a.warps),
                                              ints(a.stages)))
            if a.kernel == "serial":
                variants.insert(0, (0, 0, 0, 0, 0))         # kernels/linear.py's own tiling and launch
            for splits, bn, bk, warps, stages in variants:
                if bk * splits > k or splits == 1 and a.kernel == "partials":
                    continue        # partials of one split: scripts/probes/skinny_gemm.py's case
                bm = 16 if m <= 16 else 32 if m <= 32 else 64

                def serial(w, b):
                    from kernels.linear import splitk_linear
                    if not splits:
                        return splitk_linear(x, w, b)
                    return splitk_linear(x, w, b, splits=splits, blocks=(bm, bn, bk),
                                         launch=dict(num_warps=warps, num_stages=stages))

                def step():
                    out = None
                    for w, b in zip(ws, bs):
                        if a.kernel == "serial":        # the output, in the model's dtype, bias added
                            out = serial(w, b)
                            if not has_bias:
                                out = c_add_norm(out, res, nw)[0]
                            continue
                        p = partials(x, w, splits, bn, bk, bm, warps, stages)
                        if has_bias:        # the consumer (attend_items) would add the splits and the bias
                            out = p
                        else:
                            out = c_add_norm_parts(p, res, nw)[0]
                    return out
                label = "auto" if not splits else f"s{splits} n{bn} k{bk} w{warps} st{stages}"
                try:
                    us, out = graph_time(step, a.reps, a.layers)
                except Exception as e:  # noqa: BLE001 (a tiling the compiler refuses: say so)
                    print(f"{name:>6} {m:>4} {label:>26}  {type(e).__name__}: {str(e)[:80]}")
                    continue
                if has_bias and a.kernel == "partials":
                    out = (out.sum(0) + bs[-1].float()).half().float()
                err = (out - ref).abs().max().item()
                r = dict(shape=name, rows=m, splits=splits, block_n=bn, block_k=bk, warps=warps, stages=stages,
                         us=us, cublas_us=base_us, cublas_nobias_us=nobias, max_abs_diff=err)
                results.append(r)
                key = f"{name}@{m}"
                if err < 5e-2 and (key not in best or us < best[key]["us"]):
                    best[key] = r
                print(f"{name:>6} {m:>4} {label:>26} {us:>8.2f} {base_us:>8.2f} {base_us / us:>5.2f} {err:>9.2e}",
                      flush=True)
            if nobias is not None:
                print(f"{name:>6} {m:>4} {'cuBLAS without its bias':>26} {nobias:>8.2f}")
    print("fastest per shape and rows (GEMM + its consumer norm for o and down; q/k/v: the GEMM alone):")
    for key, r in best.items():
        extra = f", cuBLAS without bias {r['cublas_nobias_us']:.2f}" if r["cublas_nobias_us"] else ""
        tiling = "auto" if not r["splits"] else \
            f"s{r['splits']} n{r['block_n']} k{r['block_k']} w{r['warps']} st{r['stages']}"
        print(f"  {key}: {tiling} {r['us']:.2f} us against cuBLAS {r['cublas_us']:.2f}{extra} "
              f"({r['cublas_us'] / r['us']:.2f}x)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=results, best=best), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
