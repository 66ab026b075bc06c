"""One launch of one kind of the pure decode step's kernels on the 1.5B shape, between cudaProfilerStart and Stop,
for Nsight Compute: `ncu --profile-from-start off --set full python -m scripts.probes.one_launch --kind attention`.
Usage: python -m scripts.probes.one_launch --kind {qkv,attention,o,gate_up,down,lm_head} [--rows 32]

Why: scripts/probes/read_floor.py says how far each kernel is from a plain read of its bytes (the attention 1.35x
at 32 rows on the H100, q/k/v and o 1.5x); the profiler's counters (achieved DRAM throughput, occupancy, what the
warps stall on) say why. The kernel runs twice before (Triton's compile, cuBLAS's heuristics), so the profiled
launch is the steady one; operands as scripts/probes/chain.py builds them (layer 0)."""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from scripts.probes.chain import D, HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, build
from scripts.probes.skinny_gemm import ints

KINDS = ("qkv", "attention", "o", "gate_up", "down", "lm_head")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.one_launch", description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=KINDS, required=True)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompts", default="16,64,256,1024,4096", help="the rows' prompt lengths (chain.py's draw)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("one_launch: needs a CUDA device", file=sys.stderr)
        return 2
    from kernels.triton_decode import paged_decode
    dev, dt = torch.device("cuda"), torch.float16
    c = build(a.rows, 1, ints(a.prompts), dev, dt)
    w = c.weights[0]
    g = torch.Generator(device=dev).manual_seed(2)
    m = a.rows
    x = torch.randn(m, HIDDEN, device=dev, dtype=dt, generator=g)
    qkv = torch.randn(m, HEADS + 2 * KV_HEADS, D, device=dev, dtype=dt, generator=g)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
    att = torch.randn(m, HEADS * D, device=dev, dtype=dt, generator=g)
    act = torch.randn(m, INTER, device=dev, dtype=dt, generator=g) * 0.1
    lm = torch.randn(VOCAB, HIDDEN, device=dev, dtype=dt, generator=g) * 0.02
    runs = {"qkv": lambda: F.linear(x, w["qkv"], w["bqkv"]),
            "attention": lambda: paged_decode(q, *c.caches[0], c.table, c.cached, D ** -0.5, new_kv=(k, v),
                                              items=c.items, rope=(c.cos, c.sin)),
            "o": lambda: F.linear(att, w["o"]),
            "gate_up": lambda: c.mlp(x, w["gu"]),
            "down": lambda: F.linear(act, w["down"]),
            "lm_head": lambda: F.linear(x, lm)}
    run = runs[a.kind]
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print(f"one_launch: {a.kind} at {m} rows ({c.keys} cached keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
