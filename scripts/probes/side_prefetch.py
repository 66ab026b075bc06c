"""The pure decode step's layer chain with a layer's next weights fetched into L2 from a second stream while its
memory-light kernels run: 28 layers of the 1.5B shape at 32 rows in one CUDA graph, us a layer.
Usage: python -m scripts.probes.side_prefetch [--rows 32] [--programs 32,132] [--out FILE.json]

Why: at 32 rows cuBLAS runs q/k/v, o and down on 64, 48 and 72 of the H100's 132 multiprocessors, at 22-64% of its
DRAM bandwidth, and the attention's programs spend their first microseconds on a chain of small loads
(scripts/probes/read_floor.py and Nsight Compute, session 38: the layer chain 86.4 us against 62.6 for a read of
each kernel's bytes). A prefetch kernel (scripts/probes/read_kernel.py: l2_prefetch, prefetch.global.L2 with
evict_last priority) launched on a side stream at a point of the layer fills that idle bandwidth with the weights a
later kernel of the layer reads, which then come from L2. Nothing waits on the side stream but the step's end: a
prefetch is a hint, the results are the served chain's (checked). A plan names the point and the weights:
"down@attended" fetches the layer's down weights (27.5 MB) from the end of the decode, beside o and the norm;
"next-qkv@down" the next layer's q/k/v from before the down projection. The gate/up kernel's 55 MB stream passes
between most points and the down projection: L2 holds 50 MB."""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from bench.stats import graph_time
from scripts.probes.chain import add_norm, build, chain_args
from scripts.probes.skinny_gemm import ints

# plan: {hook point: [weights fetched there]}; a weight: a key of the layer's weights, or next-<key> (the next
# layer's)
PLANS = {"served": {},
         "down@start": {"start": ["down"]},
         "down@attended": {"attended": ["down"]},
         "down@mlp": {"mlp": ["down"]},
         "o@start": {"start": ["o"]},
         "o@start, down@attended": {"start": ["o"], "attended": ["down"]},
         "next-qkv@down": {"down": ["next-qkv"]},
         "o@start, down@attended, next-qkv@down": {"start": ["o"], "attended": ["down"], "down": ["next-qkv"]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.side_prefetch", description=__doc__.splitlines()[0])
    chain_args(ap)
    ap.add_argument("--programs", default="32,132", help="the prefetch kernel's programs")
    ap.add_argument("--lines", type=int, default=256, help="cache lines a program prefetches a trip")
    ap.add_argument("--plans", default=";".join(PLANS), help="which of the plans, by name (; between)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("side_prefetch: needs a CUDA device", file=sys.stderr)
        return 2
    from scripts.probes.read_kernel import l2_prefetch
    dev = torch.device("cuda")
    c = build(a.rows, a.layers, ints(a.prompts), dev)
    L = a.layers
    norm = torch.compile(add_norm, fullgraph=True)
    side = torch.cuda.Stream()

    def weight(layer, name):
        if name.startswith("next-"):
            return c.weights[layer + 1][name[5:]] if layer + 1 < L else None
        return c.weights[layer][name]

    def chain(plan, programs, evict_last):
        def fetch(layer, names):
            forked.append(layer)
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                for name in names:
                    w = weight(layer, name)
                    if w is not None:
                        l2_prefetch[(programs,)](w, w.numel(), LINES=a.lines, EVICT_LAST=evict_last, num_warps=4)

        forked = []

        def step():
            forked.clear()
            xx, res = c.x0, c.r0
            for layer, (ly, cache) in enumerate(zip(c.weights, c.caches)):
                hooks = {point: (lambda names=names, layer=layer: fetch(layer, names)) for point, names in plan.items()}
                xx, res = c.layer(xx, res, ly, cache, norm, hooks=hooks)
            if forked:      # the capture's side branch joined (a capture must end on its own stream)
                torch.cuda.current_stream().wait_stream(side)
            return xx
        return step

    names = [n.strip() for n in a.plans.split(";") if n.strip()]
    variants = [("served", {}, 0, False)]
    for name in names:
        if name != "served" and name in PLANS:
            variants += [(name, PLANS[name], p, True) for p in ints(a.programs)]
    variants.append((names[-1], PLANS.get(names[-1], {}), ints(a.programs)[-1], False))    # without evict_last
    print(f"{torch.cuda.get_device_name(dev)}: {a.rows} rows, {L} layers, {c.keys} cached keys; us a layer")
    print(f"{'plan':>44} {'programs':>8} {'evict':>5} {'us/layer':>9} {'x served':>8} {'max|diff|':>9}")
    results, ref, base = [], None, None
    for name, plan, programs, evict in variants:
        try:
            us, out = graph_time(chain(plan, programs, evict), a.reps, L)
        except Exception as e:  # noqa: BLE001 (a plan this stack cannot capture: say so, go on)
            print(f"{name:>44} {programs:>8} {str(evict):>5}  {type(e).__name__}: {str(e)[:160]}", flush=True)
            results.append(dict(plan=name, programs=programs, evict_last=evict, error=f"{type(e).__name__}: {e}"))
            continue
        if ref is None:
            ref, base = out, us
        err = (out - ref).abs().max().item()
        results.append(dict(plan=name, programs=programs, evict_last=evict, us=us, vs_served=base / us,
                            max_abs_diff=err if math.isfinite(err) else None))
        print(f"{name:>44} {programs:>8} {str(evict):>5} {us:>9.2f} {base / us:>8.3f} {err:>9.2e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=a.rows, layers=L, keys=c.keys, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
