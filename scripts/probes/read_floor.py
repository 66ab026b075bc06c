"""What the pure decode step's kernels could cost at best: each of a layer's kernels against a plain read of the
same bytes, the layer chain against a chain of those reads and against one read of the whole layer, on the 1.5B shape
in CUDA graphs of 28 layers (each layer its own buffers: nothing is served from L2 across layers).
Usage: python -m scripts.probes.read_floor [--rows 32] [--reps 50] [--out FILE.json]

Why: issue 37's floor (the step's weight and K/V bytes at the card's copy rate) says what a step that only streamed
its bytes would take, not what a chain of eight kernels a layer can reach: a kernel of a few MB spends much of its
time starting, filling the memory pipeline and draining it. A read of the same bytes by a kernel tuned only for
reading (scripts/probes/read_kernel.py, its grid and block the best of a sweep) is the least any kernel reading them
can take; against it, each served kernel's own inefficiency (what a better kernel could win) parts from the cost of
cutting the layer into eight kernels (what only fusing kernels could win). Rows:
  each kind alone   the served kernel 28 times (each layer's own weights) against 28 reads of its bytes
  layer chain       the served layer (as scripts/probes/chain.py runs it) against its eight reads in a row
  one read a layer  a single read of the layer's bytes (the floor of a layer fused into one kernel)
  copy rate         one read of 1 GB: this card's read rate, against issue 37's copy rates

Measured on an H100 in session 38 (docs/RESULTS.md, k30), 32 rows: the layer chain 86.4 us against 62.6 for its
reads and 47.2 for one read; by kind served / read: the attention 27.1 / 17.0 (attend_items 24.1, combine 2.1), q/k/v
6.2 / 4.2, o 5.5 / 3.7, down 15.0 / 11.3, the fused gate/up 22.8 / 20.0. The step at its kernels' read floors would
take 1.91 ms against 2.59 served. On an H200: the chain 74.6 / 49.0 / 34.5 us, the step 2.21 served against 1.48 at
the read floors, the attention's gap the largest (23.9 / 12.8 us: 0.31 ms a step)."""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from bench.stats import graph_time
from scripts.probes.chain import (D, HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, add_norm, build, chain_args,
                                  copy_rate)
from scripts.probes.skinny_gemm import ints


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.read_floor", description=__doc__.splitlines()[0])
    chain_args(ap)
    ap.add_argument("--programs-per-sm", default="1,2,4,8", help="the read's grid sweep, programs a multiprocessor")
    ap.add_argument("--blocks", default="1024,4096", help="the read's sweep, elements a program loads at a time")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("read_floor: needs a CUDA device", file=sys.stderr)
        return 2
    from bench.profile_steps import kernels_per_step
    from bench.stats import capture
    from kernels.triton_decode import multiprocessors, paged_decode
    from scripts.probes.read_kernel import strided_read, stream_read
    dev, dt = torch.device("cuda"), torch.float16
    m, L = a.rows, a.layers
    c = build(m, L, ints(a.prompts), dev, dt)
    sms = multiprocessors(dev.index)
    name = torch.cuda.get_device_name(dev)
    rate = copy_rate(name)
    norm = torch.compile(add_norm, fullgraph=True)
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(m, HIDDEN, device=dev, dtype=dt, generator=g)
    att = torch.randn(m, HEADS * D, device=dev, dtype=dt, generator=g)
    act = torch.randn(m, INTER, device=dev, dtype=dt, generator=g) * 0.1
    qkv_in = torch.randn(m, HEADS + 2 * KV_HEADS, D, device=dev, dtype=dt, generator=g)
    q, k, v = qkv_in[:, :HEADS], qkv_in[:, HEADS:HEADS + KV_HEADS], qkv_in[:, HEADS + KV_HEADS:]
    lm = torch.randn(VOCAB, HIDDEN, device=dev, dtype=dt, generator=g) * 0.02
    W = c.weights

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts)

    # (kind, its bytes a layer, the served kernel on layer l's own operands)
    kinds = [("add + RMSNorm", nbytes(x, x, W[0]["n1"]), lambda l: norm(x, x, W[l]["n1"])[0]),
             ("q/k/v", nbytes(W[0]["qkv"], W[0]["bqkv"]), lambda l: F.linear(x, W[l]["qkv"], W[l]["bqkv"])),
             ("attention (attend + combine)", c.kv_bytes,
              lambda l: paged_decode(q, *c.caches[l], c.table, c.cached, D ** -0.5, new_kv=(k, v), items=c.items,
                                     rope=(c.cos, c.sin))),
             ("o", nbytes(W[0]["o"]), lambda l: F.linear(att, W[l]["o"])),
             ("gate/up + SiLU-mul", nbytes(W[0]["gu"]), lambda l: c.mlp(x, W[l]["gu"])),
             ("down", nbytes(W[0]["down"]), lambda l: F.linear(act, W[l]["down"]))]
    order = [0, 1, 2, 3, 0, 4, 5]           # a layer's kernels in the chain: the norm twice
    sink = torch.empty(sms * max(ints(a.programs_per_sm)), device=dev, dtype=torch.float32)

    def reader(buf, programs, block, warps):
        def run():
            stream_read[(programs,)](buf, buf.numel(), sink, BLOCK=block, num_warps=warps, num_stages=3)
            return sink[:1]
        return run

    def chained(fns):
        def step():
            out = None
            for f in fns:
                out = f()
            return out
        return step

    def layer_buffers(size):
        return [torch.empty(size // 2, device=dev, dtype=dt).normal_(generator=g) for _ in range(L)]

    configs = list(itertools.product(ints(a.programs_per_sm), ints(a.blocks), ints(a.warps)))
    rows, best = [], {}
    print(f"{name}: {m} rows, {L} layers, {c.keys} cached keys ({c.kv_bytes / 1e6:.1f} MB of K/V a layer); "
          f"issue 37's copy rate {rate / 1e12:.2f} TB/s; read sweep {len(configs)} configurations", flush=True)
    print(f"{'kind':>30} {'MB':>7} {'served us':>9} {'read us':>8} {'x read':>7} {'TB/s read':>9} {'at rate':>8} "
          f"{'read config':>14}")
    for i, (label, size, served) in enumerate(kinds):
        bufs = layer_buffers(size)
        s_us, _ = graph_time(chained([(lambda l=l: served(l)) for l in range(L)]), a.reps, L)
        tried = []
        for per_sm, block, warps in configs:
            r_us, _ = graph_time(chained([reader(b, per_sm * sms, block, warps) for b in bufs]), a.reps, L)
            tried.append((r_us, (per_sm, block, warps)))
        r_us, cfg = min(tried)
        best[i] = (bufs, cfg)
        rows.append(dict(kind=label, bytes=size, served_us=s_us, read_us=r_us, read_config=dict(
            programs_per_sm=cfg[0], block=cfg[1], warps=cfg[2]), at_rate_us=size / rate * 1e6))
        print(f"{label:>30} {size / 1e6:>7.2f} {s_us:>9.2f} {r_us:>8.2f} {s_us / r_us:>7.2f} "
              f"{size / r_us / 1e6:>9.2f} {size / rate * 1e6:>8.2f} {str(cfg):>14}", flush=True)

    # the attention's two kernels apart (the profiler over a replay of its 28 layers), and its K/V read as the
    # decode reads it: each key/value head's 256-byte slice of every 512-byte key (the cache's [slots, heads, d]),
    # a head a grid column, against the contiguous read above
    graph, _ = capture(chained([(lambda l=l: kinds[2][2](l)) for l in range(L)]))
    split = kernels_per_step(lambda: (graph.replay(), torch.cuda.synchronize()), a.reps, True)
    for kernel in ("attend_items", "combine_items"):
        us = sum(t for n, t in split.items() if kernel in n) / L
        rows.append(dict(kind=f"attention: {kernel}", served_us=us))
        print(f"{'  ' + kernel:>30} {'':>7} {us:>9.2f}", flush=True)
    kv_bufs = best[2][0]
    records = c.kv_bytes // (KV_HEADS * D * 2)
    tried = []
    for per_sm, block, warps in configs:
        def strided(buf, programs=max(1, per_sm * sms // KV_HEADS), block_rows=max(1, block // D), warps=warps):
            def run():
                strided_read[(programs, KV_HEADS)](buf, records, sink, ROW=D, STRIDE=KV_HEADS * D,
                                                   BLOCK_ROWS=block_rows, num_warps=warps, num_stages=3)
                return sink[:1]
            return run
        tried.append((graph_time(chained([strided(b) for b in kv_bufs]), a.reps, L)[0], (per_sm, block, warps)))
    st_us, st_cfg = min(tried)
    rows.append(dict(kind="K/V read by head slices", bytes=c.kv_bytes, read_us=st_us, read_config=dict(
        programs_per_sm=st_cfg[0], block=st_cfg[1], warps=st_cfg[2])))
    print(f"{'K/V read by head slices':>30} {c.kv_bytes / 1e6:>7.2f} {'':>9} {st_us:>8.2f} {'':>7} "
          f"{c.kv_bytes / st_us / 1e6:>9.2f} {c.kv_bytes / rate * 1e6:>8.2f} {str(st_cfg):>14}", flush=True)

    def read_of(i, l):
        bufs, (per_sm, block, warps) = best[i]
        return reader(bufs[l], per_sm * sms, block, warps)

    def served_layer():
        xx, res = c.x0, c.r0
        for ly, cache in zip(c.weights, c.caches):
            xx, res = c.layer(xx, res, ly, cache, norm)
        return xx

    chain_us, _ = graph_time(served_layer, a.reps, L)
    reads_us, _ = graph_time(chained([read_of(i, l) for l in range(L) for i in order]), a.reps, L)
    layer_bytes = sum(kinds[i][1] for i in order)
    whole = layer_buffers(layer_bytes)
    tried = [(graph_time(chained([reader(b, per_sm * sms, block, warps) for b in whole]), a.reps, L)[0],
              (per_sm, block, warps)) for per_sm, block, warps in configs]
    one_us, one_cfg = min(tried)
    big = torch.empty(1 << 29, device=dev, dtype=dt).normal_(generator=g)             # 1 GiB
    copy_us = min(graph_time(reader(big, per_sm * sms, block, warps), a.reps)[0]
                  for per_sm, block, warps in configs)
    copy = big.numel() * 2 / copy_us / 1e6
    lm_us, _ = graph_time(lambda: F.linear(x, lm), a.reps)
    lm_read = min(graph_time(reader(lm.view(-1), per_sm * sms, block, warps), a.reps)[0]
                  for per_sm, block, warps in configs)
    summary = dict(chain_us=chain_us, read_chain_us=reads_us, one_read_us=one_us, one_read_config=one_cfg,
                   layer_bytes=layer_bytes, at_rate_us=layer_bytes / rate * 1e6, read_rate_tbs=copy,
                   lm_head_us=lm_us, lm_head_read_us=lm_read)
    print(f"\n{'a layer':>30} {layer_bytes / 1e6:>7.2f} {chain_us:>9.2f} {reads_us:>8.2f} {chain_us / reads_us:>7.2f} "
          f"{layer_bytes / reads_us / 1e6:>9.2f} {layer_bytes / rate * 1e6:>8.2f}  (the chain; its {len(order)} reads)")
    print(f"{'one read a layer':>30} {layer_bytes / 1e6:>7.2f} {'':>9} {one_us:>8.2f} {chain_us / one_us:>7.2f} "
          f"{layer_bytes / one_us / 1e6:>9.2f} {layer_bytes / rate * 1e6:>8.2f} {str(one_cfg):>14}")
    print(f"{'LM head (once a step)':>30} {lm.numel() * 2 / 1e6:>7.2f} {lm_us:>9.2f} {lm_read:>8.2f} "
          f"{lm_us / lm_read:>7.2f} {lm.numel() * 2 / lm_read / 1e6:>9.2f} {lm.numel() * 2 / rate * 1e6:>8.2f}")
    print(f"read rate of 1 GiB: {copy:.2f} TB/s (issue 37's {rate / 1e12:.2f})")
    step = dict(served=chain_us * L + lm_us, read_chain=reads_us * L + lm_read, one_read=one_us * L + lm_read,
                at_rate=(layer_bytes * L + lm.numel() * 2) / rate * 1e6)
    summary["step_ms"] = {k: v / 1e3 for k, v in step.items()}
    print("a step's layers and LM head, ms: " + ", ".join(f"{k} {v / 1e3:.3f}" for k, v in step.items()))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=name, rows=m, layers=L, keys=c.keys, kinds=rows, **summary), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
