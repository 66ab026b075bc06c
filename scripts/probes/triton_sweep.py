"""The Triton decode's tiling on a GPU: per-layer time of kernels/triton_decode.paged_decode inside a CUDA graph, by
item size (CHUNK), key block (BLOCK_N), warps and pipeline stages.

Why: in the 32-row pure decode step on the H200 the Triton decode took 0.60 ms of the step's 2.14 ms of device time
(attend_items 0.43, combine_items 0.17: docs/RESULTS.md), for about 27 MB of K and V a layer, a third of the copy
bandwidth. Its tiling was chosen once; this measures the alternatives over the same histories as the flash probe
(the mixed draw's 32 rows, the 1.5B shape's 12 query / 2 key-value heads of 128, 256-slot pages), 28 layer calls a
replay with the served fused append, and checks every variant's output against the current tiling's.

    python -m scripts.probes.triton_sweep --out results/triton_sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys

import torch

from bench.stats import graph_time
from kernels import triton_decode as td
from scripts.probes.flash_splits import HEAD_DIM, KV_HEADS, PAGE, Q_HEADS, paged_caches, probe_args, write_out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.triton_sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--chunks", default="128,256,512")
    ap.add_argument("--blocks", default="32,64,128")
    ap.add_argument("--warps", default="2,4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--combine-warps", default="", help="combine_items' num_warps to time at the current tiling")
    ap.add_argument("--programs-per-sm", default="", help="attend_items' persistent programs a multiprocessor, swept "
                    f"with each tiling (none given: the kernel's {td.PROGRAMS_PER_SM})")
    ap.add_argument("--maxnreg", default="", help="registers a thread the compiler may use, swept with each tiling "
                    "(Triton's maxnreg; none given: no cap): fewer let more programs reside on a multiprocessor")
    probe_args(ap)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("triton_sweep: needs a CUDA device", file=sys.stderr)
        return 2
    dev, dt, (P, Hq, Hk, D) = torch.device("cuda"), torch.float16, (PAGE, Q_HEADS, KV_HEADS, HEAD_DIM)
    hist, tables, caches, g = paged_caches(a.rows, a.layers)
    need = [len(t) for t in tables]
    num_pages = caches[0][0].shape[0]
    qkv = torch.randn(a.rows, Hq + 2 * Hk, D, generator=g, device=dev, dtype=dt)   # the model's fused [q|k|v]
    q, new_kv = qkv[:, :Hq], (qkv[:, Hq:Hq + Hk], qkv[:, Hq + Hk:])
    cached = torch.tensor([h - 1 for h in hist], dtype=torch.int32, device=dev)     # the new key appended
    W = max(need)
    bt = torch.tensor([t + [0] * (W - len(t)) for t in tables], dtype=torch.int32, device=dev)

    def variant(chunk, block_n, launch, combine_launch=None, programs=None):
        items = td.work_items(cached, td.max_items(a.rows, W * P, num_pages * P, chunk), chunk, bt, P)

        def step():
            out = None
            for k, v in caches:
                out = td.paged_decode(q, k, v, bt, cached, D ** -0.5, new_kv, chunk=chunk, items=items,
                                      block_n=block_n, launch=launch, combine_launch=combine_launch,
                                      programs=programs)
            return out
        return step

    us, ref = graph_time(variant(td.CHUNK, td.BLOCK_N, td.LAUNCH), a.reps, a.layers)
    rows = [dict(chunk=td.CHUNK, block_n=td.BLOCK_N, num_warps=td.LAUNCH.get("num_warps"),
                 num_stages=td.LAUNCH.get("num_stages"), programs_per_sm=td.PROGRAMS_PER_SM, current=True,
                 us_per_layer=us, max_abs_diff=0.0)]
    sms = td.multiprocessors(dev.index)
    for chunk, block_n, warps, stages, per_sm, nreg in itertools.product(
            ints(a.chunks), ints(a.blocks), ints(a.warps), ints(a.stages), ints(a.programs_per_sm) or [0],
            ints(a.maxnreg) or [0]):
        if chunk % block_n or P % block_n:
            continue
        launch = dict(num_warps=warps, num_stages=stages, **({"maxnreg": nreg} if nreg else {}))
        programs = max(1, -(-sms * per_sm // Hk)) if per_sm else None
        label = dict(chunk=chunk, block_n=block_n, num_warps=warps if not nreg else f"{warps}r{nreg}",
                     num_stages=stages, programs_per_sm=per_sm or td.PROGRAMS_PER_SM)
        try:
            us, out = graph_time(variant(chunk, block_n, launch, programs=programs), a.reps, a.layers)
            err = (out - ref).abs().max().item()
        except Exception as e:          # a tiling the compiler refuses (shared memory, registers): say so
            rows.append(dict(label, error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        rows.append(dict(label, us_per_layer=us, max_abs_diff=err))
    for cw in ints(a.combine_warps):
        us, out = graph_time(variant(td.CHUNK, td.BLOCK_N, td.LAUNCH, dict(num_warps=cw)), a.reps, a.layers)
        rows.append(dict(chunk=td.CHUNK, block_n=td.BLOCK_N, num_warps=f"{td.LAUNCH.get('num_warps')} c{cw}",
                         num_stages=td.LAUNCH.get("num_stages"), combine_warps=cw, us_per_layer=us,
                         max_abs_diff=(out - ref).abs().max().item()))
    kv_bytes = sum(hist) * Hk * D * 2 * 2
    print(f"triton decode in a CUDA graph: {a.rows} rows, histories mean {statistics.mean(hist):.0f} max "
          f"{max(hist)}, {kv_bytes / 1e6:.1f} MB of K+V per layer; the current tiling first")
    print(f"{'chunk':>6} {'block_n':>7} {'warps':>5} {'stages':>6} {'p/sm':>4} {'us/layer':>9} {'max|diff|':>10}")
    for r in rows:
        head = (f"{r['chunk']:>6} {r['block_n']:>7} {str(r['num_warps']):>5} {str(r['num_stages']):>6} "
                f"{str(r.get('programs_per_sm', '')):>4}")
        if "error" in r:
            print(f"{head}  {r['error']}")
            continue
        print(f"{head} {r['us_per_layer']:>9.1f} {r['max_abs_diff']:>10.2e}")
    ok = [r for r in rows if "error" not in r and r["max_abs_diff"] < 2e-2]
    best = min(ok, key=lambda r: r["us_per_layer"])
    print(f"fastest: {best} against the current {rows[0]['us_per_layer']:.1f} us/layer")
    write_out(a.out, histories=hist, rows=rows, best=best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
