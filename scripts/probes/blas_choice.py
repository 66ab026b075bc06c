"""Which cuBLAS path serves the 1.5B shape's skinny projections best: microseconds a call of each projection at
decode-step row counts, 28 calls over 28 layers' own weights in a CUDA graph (as in a step: the weights do not
stay in L2), for torch's BLAS library choices (`torch.backends.cuda.preferred_blas_library`: cuBLAS, cuBLASLt) and
two weight layouts (F.linear's [out, in] weight, and its transpose stored [in, out] for x @ w: another GEMM form,
so other kernels). Every variant's output is checked against F.linear's.

Why: in the 32-row pure decode step (session 16's profile, docs/RESULTS.md) the GEMMs took 1.26 ms against the
0.73 ms their weights take to read: gate/up 18.3 us a layer for 55 MB (cuBLAS's 192-column tile gives 93 blocks to
the H200's 132 multiprocessors), down 10.0 us split-K, q/k/v and o 5-6 us. A library or layout that picks a better
kernel is a switch of the runner, not a kernel of ours.

    python -m scripts.probes.blas_choice [--rows 1,8,32,64] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from bench.stats import graph_time

from .skinny_gemm import SHAPES, ints


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.blas_choice", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("blas_choice: needs a CUDA device", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.float16
    g = torch.Generator(device=dev).manual_seed(0)
    libs = ["cublas", "cublaslt"]
    results = []
    print(f"{'shape':>8} {'rows':>4} " + " ".join(f"{lib + '/' + lay:>16}" for lib in libs for lay in ("out-in", "in-out"))
          + "  (us a call)")
    for name, (n, k, has_bias) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=dt, generator=g) * 0.02 for _ in range(a.layers)]
        wts = [w.t().contiguous() for w in ws]
        bs = [torch.randn(n, device=dev, dtype=dt, generator=g) if has_bias else None for _ in range(a.layers)]
        for m in ints(a.rows):
            x = torch.randn(m, k, device=dev, dtype=dt, generator=g)
            ref = F.linear(x, ws[0], bs[0]).float()
            row = dict(shape=name, rows=m, n=n, k=k, bytes_a_call=n * k * 2)
            for lib in libs:
                torch.backends.cuda.preferred_blas_library(lib)
                for lay in ("out-in", "in-out"):
                    def step():
                        out = None
                        for i in range(a.layers):
                            if lay == "out-in":
                                out = F.linear(x, ws[i], bs[i])
                            else:
                                out = torch.addmm(bs[i], x, wts[i]) if bs[i] is not None else x @ wts[i]
                        return out
                    us, out = graph_time(step, a.reps, per=a.layers)
                    # the last call's output is layer 27's: check layer 0's form against F.linear once
                    check = (F.linear(x, ws[0], bs[0]) if lay == "out-in" else
                             (torch.addmm(bs[0], x, wts[0]) if bs[0] is not None else x @ wts[0])).float()
                    row[f"{lib}/{lay}"] = round(us, 2)
                    row[f"{lib}/{lay}/diff"] = float((check - ref).abs().max())
            torch.backends.cuda.preferred_blas_library("cublas")
            results.append(row)
            print(f"{name:>8} {m:>4} " + " ".join(f"{row[f'{lib}/{lay}']:>16.2f}" for lib in libs
                                                 for lay in ("out-in", "in-out")))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
