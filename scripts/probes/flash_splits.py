"""flash-attn's paged decode inside a CUDA graph: per-layer time by split count and block-table width.

Why: inside a captured decode step flash decode ran slower per layer call than the eager kernel benchmark on the same
histories (docs/RESULTS.md). The graph's block table is as wide as the longest request the engine admits (128 pages
of 256 slots), and flash-attn sizes its split-KV heuristic from that width and from the row count, never from the
rows' true lengths: one long row then runs unsplit while most SMs idle.

This captures 28 layer calls (each layer its own cache, as in the model) for each (table width, num_splits) and
times replays with CUDA events; it prints a table and the fastest split count, and writes --out (JSON).

    STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext python -m scripts.probes.flash_splits --out results/flash_splits.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from engine.workload import MIXED
from kernels.flash_backend import _import_flash, decode_splits_for

from bench.stats import graph_time


# the 1.5B shape's attention: 256-slot pages, 12 query and 2 key/value heads of 128
PAGE, Q_HEADS, KV_HEADS, HEAD_DIM = 256, 12, 2, 128


def probe_args(ap) -> None:
    """The options every flash probe takes: layer calls per replay, replays, the JSON output."""
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)


def paged_caches(rows: int, layers: int, seed: int = 0):
    """The probes' decode state on CUDA: `rows` histories of the mixed draw (prompt + 1 decoded), their pages handed
    out in order after the null page 0, `layers` random fp16 K/V caches of that many pages. -> (histories, block
    tables as lists, caches, the generator for anything else random)."""
    dev = torch.device("cuda")
    hist = [len(s.prompt) + 1 for s in MIXED.scaled(rows).requests()][:rows]
    tables, nxt = [], 1
    for h in hist:
        n = -(-h // PAGE)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    g = torch.Generator(device=dev).manual_seed(seed)
    caches = [tuple(torch.randn(nxt, PAGE, KV_HEADS, HEAD_DIM, generator=g, device=dev, dtype=torch.float16)
                    for _ in range(2)) for _ in range(layers)]
    return hist, tables, caches, g


def write_out(path: str | None, **data) -> None:
    """--out: the probe's figures as JSON (nothing without it)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2))


def have_flash(prog: str) -> bool:
    """flash-attn imports here; if not, say why on stderr."""
    fa, reason = _import_flash()
    if fa is None:
        print(f"{prog}: {reason}", file=sys.stderr)
    return fa is not None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.flash_splits", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--splits", default="auto,0,8,16,32,64",
                    help="num_splits values; 'auto': the flash backend's rule for the width and rows "
                    "(decode_splits_for)")
    ap.add_argument("--widths", default="fit,32,64,128",
                    help="block-table widths: 'fit' (the longest row's pages) or a number")
    probe_args(ap)
    a = ap.parse_args(argv)
    if not have_flash("flash_splits"):
        return 2
    from flash_attn import flash_attn_with_kvcache
    dev, dt, (P, Hq, Hk, D) = torch.device("cuda"), torch.float16, (PAGE, Q_HEADS, KV_HEADS, HEAD_DIM)
    hist, tables, caches, g = paged_caches(a.rows, a.layers)
    need = [len(t) for t in tables]
    # q as the model hands it over: a strided view of the rotated [q | k] heads
    qk = torch.randn(a.rows, Hq + Hk, D, generator=g, device=dev, dtype=dt)
    q = qk[:, :Hq].unsqueeze(1)
    seqlens = torch.tensor(hist, dtype=torch.int32, device=dev)
    rows = []
    ref = None
    for width in a.widths.split(","):
        W = max(need) if width == "fit" else int(width)
        bt = torch.tensor([t + [0] * (W - len(t)) for t in tables], dtype=torch.int32, device=dev)
        for ns in (decode_splits_for(W * P, D, a.rows, Hk) if x == "auto" else int(x) for x in a.splits.split(",")):
            def step():
                out = None
                for k, v in caches:
                    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=bt,
                                                  softmax_scale=D ** -0.5, causal=True, num_splits=ns)
                return out
            us, out = graph_time(step, a.reps, a.layers)
            if ref is None:
                ref = out
            err = (out - ref).abs().max().item()
            rows.append(dict(width=W, num_splits=ns, auto=ns == decode_splits_for(W * P, D, a.rows, Hk),
                             us_per_layer=us, max_abs_diff=err))
    kv_bytes = sum(hist) * Hk * D * 2 * 2
    print(f"flash decode in a CUDA graph: {a.rows} rows, histories mean {statistics.mean(hist):.0f} max {max(hist)}, "
          f"{kv_bytes / 1e6:.1f} MB of K+V per layer")
    print(f"{'width':>6} {'num_splits':>10} {'us/layer':>9} {'max|diff|':>10}")
    for r in rows:
        mark = " (the backend's rule)" if r["auto"] else ""
        print(f"{r['width']:>6} {r['num_splits']:>10} {r['us_per_layer']:>9.1f} {r['max_abs_diff']:>10.2e}{mark}")
    wide = [r for r in rows if r["width"] == max(x["width"] for x in rows)]
    best = min(wide, key=lambda r: r["us_per_layer"])
    print(f"fastest at width {best['width']}: num_splits={best['num_splits']} ({best['us_per_layer']:.1f} us/layer)")
    write_out(a.out, histories=hist, rows=rows, best=best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
