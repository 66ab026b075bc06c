"""flash-attn's paged prompt-chunk attention in a CUDA graph: the varlen kernel against `with_kvcache` by split count.

Why: flash-attn 2 runs a paged varlen call (our prefill) through its split-KV kernel with ONE split: a 512-position
chunk on 12 query heads is 8 row blocks x 12 heads = 96 CTAs of 4 warps on a 132-SM H200, each walking the whole
history alone. `flash_attn_with_kvcache` takes the same paged cache with several query positions per sequence and a
`num_splits`, so a chunk with a long history can spread over the SMs. This times both, 28 layer calls (each layer its
own cache, as in the model) per replay, for one chunk at each history length, and checks they agree.

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.flash_prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--histories", default="0,512,2048,4096", help="cached positions before the chunk")
    ap.add_argument("--splits", default="1,2,4,8,16", help="num_splits values tried with with_kvcache")
    ap.add_argument("--width", default="fit", help="block-table width in pages: 'fit' or a number (a captured "
                    "step's table is as wide as its bucket)")
    probe_args(ap)
    a = ap.parse_args(argv)
    if not have_flash("flash_prefill"):
        return 2
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    dev, dt, (P, Hq, Hk, D) = torch.device("cuda"), torch.float16, (PAGE, Q_HEADS, KV_HEADS, HEAD_DIM)
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
        for ns in (int(x) for x in a.splits.split(",")):
            def kvcache(ns=ns):
                out = None
                for k, v in caches:
                    out = flash_attn_with_kvcache(q.unsqueeze(0), k, v, cache_seqlens=seqlens, block_table=bt,
                                                  softmax_scale=D ** -0.5, causal=True, num_splits=ns)
                return out.squeeze(0)
            us, out = graph_time(kvcache, a.reps, a.layers)
            rows.append(dict(history=hist, kernel="with_kvcache", num_splits=ns, us_per_layer=us,
                             max_abs_diff=(out - ref).abs().max().item()))
        del caches
    print(f"paged chunk attention in a CUDA graph: chunk {a.chunk}, {Hq} query / {Hk} key-value heads, width {a.width}")
    print(f"{'history':>8} {'kernel':>13} {'num_splits':>10} {'us/layer':>9} {'max|diff|':>10}")
    for r in rows:
        print(f"{r['history']:>8} {r['kernel']:>13} {r['num_splits']:>10} {r['us_per_layer']:>9.1f} "
              f"{r['max_abs_diff']:>10.2e}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(chunk=a.chunk, width=a.width, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
