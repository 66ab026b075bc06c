"""flash-attn's paged prompt-chunk attention in a CUDA graph: the varlen kernel against `with_kvcache` by split count.

Why: flash-attn 2 runs a paged varlen call (our prefill) through its split-KV kernel with ONE split: a 512-position
chunk on 12 query heads is 8 row blocks x 12 heads = 96 CTAs of 4 warps on a 132-SM H200, each walking the whole
history alone. `flash_attn_with_kvcache` takes the same paged cache with several query positions per sequence and a
`num_splits`, so a chunk with a long history can spread over the SMs. This times both, 28 layer calls (each layer its
own cache, as in the model) per replay, for one chunk at each history length, and checks they agree.

Layouts (all against the one-sequence varlen call's output):
- varlen:          the chunk as one sequence (the eager step's call);
- varlen-pieces:   the chunk as Q_TILE-row pieces, each a sequence whose history ends at its last row, all on the
                   chunk's table row (engine/step_graphs.py: what a captured loaded step runs now);
- varlen-step:     the captured loaded step's whole varlen call before session 33: --lead decode rows first (each a
                   sequence of one query over one key), the pieces, padding pieces up to --bucket;
- varlen-step-1seq: the same with the decode rows as one sequence of --lead queries over one key (at most 64 rows:
                   the captured step's layout since session 33, which cuts them into sequences of Q_TILE);
- kvcache:         `with_kvcache`, q [1, chunk, H, d], by num_splits;
- kvcache-pieces:  `with_kvcache`, q [pieces, Q_TILE, H, d] with each piece's cache length, by num_splits: the
                   layout a captured step could give it (its pieces are Q_TILE rows; a shorter last piece would be
                   left-padded), with ...+gather the gather of the pieces' rows from the packed step and the scatter
                   of the output back (the two copies a layer that layout costs where the pieces do not start at a
                   fixed row).

    STEPGATE_FLASH_ATTN_PATH=/tmp/fa/src:/tmp/fa/ext python -m scripts.probes.flash_prefill --out results/flash_prefill.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .flash_splits import HEAD_DIM, KV_HEADS, PAGE, Q_HEADS, have_flash, probe_args
from bench.stats import graph_time
from engine.step_graphs import Q_TILE


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.flash_prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--histories", default="0,512,2048,4096", help="cached positions before the chunk")
    ap.add_argument("--splits", default="1,2,4,8,16", help="num_splits values tried with with_kvcache")
    ap.add_argument("--width", default="fit", help="block-table width in pages: 'fit' or a number (a captured "
                    "step's table is as wide as its bucket)")
    ap.add_argument("--lead", type=int, default=32, help="decode rows in front of the chunk (the varlen-step layouts)")
    ap.add_argument("--bucket", type=int, default=640, help="the captured step's token bucket (the varlen-step "
                    "layouts: 32 rows + chunk 512 take 640)")
    ap.add_argument("--device", default="cuda", help="cuda (tests/test_flash_splits.py runs the layouts on a CPU "
                    "with flash-attn's calls emulated)")
    probe_args(ap)
    a = ap.parse_args(argv)
    if not have_flash("flash_prefill"):
        return 2
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    dev, dt, (P, Hq, Hk, D) = torch.device(a.device), torch.float16, (PAGE, Q_HEADS, KV_HEADS, HEAD_DIM)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for hist in (int(h) for h in a.histories.split(",")):
        total = hist + a.chunk
        need = -(-total // P)
        W = need if a.width == "fit" else max(need, int(a.width))
        caches = [(torch.randn(need + 1, P, Hk, D, generator=g, device=dev, dtype=dt),
                   torch.randn(need + 1, P, Hk, D, generator=g, device=dev, dtype=dt)) for _ in range(a.layers)]
        bt = torch.tensor([list(range(1, need + 1)) + [0] * (W - need)], dtype=torch.int32, device=dev)
        q = torch.randn(a.chunk, Hq, D, generator=g, device=dev, dtype=dt)
        cu_q = torch.tensor([0, a.chunk], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, total], dtype=torch.int32, device=dev)
        seqlens = torch.tensor([total], dtype=torch.int32, device=dev)

        def varlen():
            out = None
            for k, v in caches:
                out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, a.chunk, W * P, softmax_scale=D ** -0.5,
                                             causal=True, block_table=bt)
            return out
        us, ref = graph_time(varlen, a.reps, a.layers)
        rows.append(dict(history=hist, kernel="varlen", num_splits=1, us_per_layer=us, max_abs_diff=0.0))
        # the captured step's layout: Q_TILE-row pieces, each its own sequence on the chunk's table row
        pieces = -(-a.chunk // Q_TILE)
        piece_q = [min(Q_TILE, a.chunk - Q_TILE * i) for i in range(pieces)]
        ends = [hist + sum(piece_q[:i + 1]) for i in range(pieces)]
        cu_qp = torch.tensor([0] + [sum(piece_q[:i + 1]) for i in range(pieces)], dtype=torch.int32, device=dev)
        cu_kp = torch.tensor([0] + [sum(ends[:i + 1]) for i in range(pieces)], dtype=torch.int32, device=dev)
        btp = bt.expand(pieces, -1).contiguous()
        lens_p = torch.tensor(ends, dtype=torch.int32, device=dev)

        def varlen_pieces():
            out = None
            for k, v in caches:
                out = flash_attn_varlen_func(q, k, v, cu_qp, cu_kp, Q_TILE, W * P, softmax_scale=D ** -0.5,
                                             causal=True, block_table=btp)
            return out
        us, out = graph_time(varlen_pieces, a.reps, a.layers)
        rows.append(dict(history=hist, kernel="varlen-pieces", num_splits=1, us_per_layer=us,
                         max_abs_diff=(out - ref).abs().max().item()))
        # the whole varlen call of a captured loaded step (engine/step_graphs.py): `lead` decode rows first, each
        # a sequence of one query over one key, then the pieces, then padding pieces on the pad page (page 0 here)
        # up to the bucket; and the same with the decode rows as ONE sequence of `lead` queries over one key (the
        # rows a decode call's output replaces: only the chunk's rows are compared)
        for name, one in (("varlen-step", False), ("varlen-step-1seq", True)):
            pad = a.bucket - a.lead - a.chunk
            pad_q = [min(Q_TILE, pad - Q_TILE * i) for i in range(-(-pad // Q_TILE))] if pad > 0 else []
            lead_q, lead_k = ([a.lead], [1]) if one else ([1] * a.lead, [1] * a.lead)
            qs = lead_q + piece_q + pad_q
            ks = lead_k + ends + pad_q
            cu_qs = torch.tensor([0] + torch.tensor(qs).cumsum(0).tolist(), dtype=torch.int32, device=dev)
            cu_ks = torch.tensor([0] + torch.tensor(ks).cumsum(0).tolist(), dtype=torch.int32, device=dev)
            bts = torch.cat([torch.zeros(len(lead_q), W, dtype=torch.int32, device=dev), btp,
                             torch.zeros(len(pad_q), W, dtype=torch.int32, device=dev)])
            qstep = torch.randn(a.bucket, Hq, D, generator=g, device=dev, dtype=dt)
            qstep[a.lead:a.lead + a.chunk] = q

            def varlen_step(cu_qs=cu_qs, cu_ks=cu_ks, bts=bts, qstep=qstep):
                out = None
                for k, v in caches:
                    out = flash_attn_varlen_func(qstep, k, v, cu_qs, cu_ks, Q_TILE if not one else max(Q_TILE, a.lead),
                                                 W * P, softmax_scale=D ** -0.5, causal=True, block_table=bts)
                return out[a.lead:a.lead + a.chunk]
            us, out = graph_time(varlen_step, a.reps, a.layers)
            rows.append(dict(history=hist, kernel=name, num_splits=1, us_per_layer=us,
                             max_abs_diff=(out - ref).abs().max().item()))
        # the packed step as a captured step holds it (decode rows first), and the pieces' rows in it
        lead = 32
        packed = torch.randn(lead + a.chunk, Hq, D, generator=g, device=dev, dtype=dt)
        packed[lead:] = q
        piece_rows = torch.arange(lead, lead + a.chunk, device=dev)
        packed_out = torch.zeros_like(packed)
        for ns in (int(x) for x in a.splits.split(",")):
            def kvcache(ns=ns):
                out = None
                for k, v in caches:
                    out = flash_attn_with_kvcache(q.unsqueeze(0), k, v, cache_seqlens=seqlens, block_table=bt,
                                                  softmax_scale=D ** -0.5, causal=True, num_splits=ns)
                return out.squeeze(0)

            def kvcache_pieces(ns=ns):
                out = None
                for k, v in caches:
                    out = flash_attn_with_kvcache(q.view(pieces, Q_TILE, Hq, D), k, v, cache_seqlens=lens_p,
                                                  block_table=btp, softmax_scale=D ** -0.5, causal=True,
                                                  num_splits=ns)
                return out.reshape(a.chunk, Hq, D)

            def kvcache_pieces_gather(ns=ns):
                for k, v in caches:
                    qp = packed.index_select(0, piece_rows).view(pieces, Q_TILE, Hq, D)
                    o = flash_attn_with_kvcache(qp, k, v, cache_seqlens=lens_p, block_table=btp,
                                                softmax_scale=D ** -0.5, causal=True, num_splits=ns)
                    packed_out.index_copy_(0, piece_rows, o.reshape(a.chunk, Hq, D))
                return packed_out[lead:]
            for name, fn in (("kvcache", kvcache), ("kvcache-pieces", kvcache_pieces),
                             ("kvcache-pieces+gather", kvcache_pieces_gather)):
                if name != "kvcache" and a.chunk % Q_TILE:
                    continue        # pieces of Q_TILE rows each: a shorter last piece would need left padding
                us, out = graph_time(fn, a.reps, a.layers)
                rows.append(dict(history=hist, kernel=name, num_splits=ns, us_per_layer=us,
                                 max_abs_diff=(out - ref).abs().max().item()))
        del caches
    print(f"paged chunk attention in a CUDA graph: chunk {a.chunk}, {Hq} query / {Hk} key-value heads, width {a.width}")
    print(f"{'history':>8} {'kernel':>22} {'num_splits':>10} {'us/layer':>9} {'max|diff|':>10}")
    for r in rows:
        print(f"{r['history']:>8} {r['kernel']:>22} {r['num_splits']:>10} {r['us_per_layer']:>9.1f} "
              f"{r['max_abs_diff']:>10.2e}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(chunk=a.chunk, width=a.width, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
