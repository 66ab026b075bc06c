"""A pure decode step's layer chain on a GPU with and without programmatic dependent launch (PDL): 28 layers of the
1.5B shape at 32 rows in one CUDA graph, each layer as the engine runs it (add + RMSNorm compiled, q/k/v, the Triton
decode with its append and rotary, o, add + RMSNorm, the fused gate/up + SiLU-mul, down), microseconds a layer.
Usage: python -m scripts.probes.pdl_chain [--rows 32] [--mlp-prefetch 0,256,768] [--out FILE.json]

Why: inside a captured step each of the layer's eight or nine kernels starts only when the one before has ended;
the step's device time in kernels (1.96 ms on the H200) is below its wall time (2.2-2.4 ms), and at 32 rows the
projections' weights are read at a fraction of the copy rate. With PDL (kernels/pdl_kernels.py) a Triton kernel's
programs start while the kernel before runs, fetch their weight rows into L2, and wait for it only before they read
its output. cuBLAS's kernels take no part, so the variants are: the served chain (cuBLAS projections, no PDL); it
with PDL on the Triton kernels (decode, MLP, and Inductor's norms where this torch can); kernels/linear.py's split-K
projections without PDL (session 36: 1.071x slower in the step); the same with PDL; and with PDL and the weight
prefetch (the split's whole rows for the projections; --mlp-prefetch elements of each gate/up row). Every variant's
output is held against the served chain's."""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from bench.stats import graph_time
from scripts.probes.chain import add_norm, build, chain_args, copy_rate
from scripts.probes.skinny_gemm import ints


def inductor_pdl() -> bool:
    """Whether this torch's Inductor can generate PDL code (torch._inductor.config.triton.enable_pdl)."""
    import torch._inductor.config as cfg
    return hasattr(cfg.triton, "enable_pdl")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.pdl_chain", description=__doc__.splitlines()[0])
    chain_args(ap)
    ap.add_argument("--mlp-prefetch", default="0,256,768", help="gate/up elements a row prefetched (PDL variants)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pdl_chain: needs a CUDA device", file=sys.stderr)
        return 2
    from kernels.linear import splitk_linear
    from kernels.pdl import why_unavailable
    why = why_unavailable("cuda")
    if why:
        print(f"pdl_chain: {why}", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    c = build(a.rows, a.layers, ints(a.prompts), dev)
    m, L = a.rows, a.layers
    kv_bytes, w_bytes = c.kv_bytes, c.w_bytes
    name = torch.cuda.get_device_name(dev)
    rate = copy_rate(name)
    floor_us = (w_bytes + kv_bytes) / rate * 1e6
    norms = {False: torch.compile(add_norm, fullgraph=True)}
    if inductor_pdl():
        norms[True] = torch.compile(add_norm, fullgraph=True, options={"triton.enable_pdl": True})

    def chain(linear_kernel: str, pdl: bool, lin_prefetch: int, mlp_prefetch: int, norm_pdl: bool):
        norm = norms.get(norm_pdl, norms[False])

        def lin(x, w, b=None):
            if linear_kernel == "torch":
                return F.linear(x, w, b)
            return splitk_linear(x, w, b, pdl=pdl, prefetch=lin_prefetch)

        def step():
            x, res = c.x0, c.r0
            for ly, cache in zip(c.weights, c.caches):
                x, res = c.layer(x, res, ly, cache, norm, lin, pdl, mlp_prefetch)
            return x
        return step

    # (label, projections, PDL on the Triton kernels, the projections' prefetch, the MLP's, PDL on the norms)
    variants = [("served (cuBLAS, no PDL)", "torch", False, 0, 0, False),
                ("split-K, no PDL", "triton", False, 0, 0, False),
                ("split-K, PDL, norms without", "triton", True, 1 << 30, 0, False)]
    for pf in ints(a.mlp_prefetch):
        variants += [(f"cuBLAS, PDL, mlp prefetch {pf}", "torch", True, 0, pf, True),
                     (f"split-K, PDL, mlp prefetch {pf}", "triton", True, 0, pf, True),
                     (f"split-K, PDL + prefetch, mlp {pf}", "triton", True, 1 << 30, pf, True)]
    print(f"rows {m}, {L} layers, keys {c.keys} ({kv_bytes / 1e6:.1f} MB of K/V a layer), weights "
          f"{w_bytes / 1e6:.1f} MB a layer: floor {floor_us:.2f} us a layer at {rate / 1e12:.2f} TB/s ({name}); "
          f"Inductor PDL: {'yes' if inductor_pdl() else 'no (the norms launch without it)'}")
    print(f"{'variant':>36} {'us/layer':>9} {'x served':>9} {'floor/us':>8} {'max|diff|':>9}")
    results, ref, base = [], None, None
    for label, kern, pdl, lpf, mpf, npdl in variants:
        try:
            us, out = graph_time(chain(kern, pdl, lpf, mpf, npdl), a.reps, L)
        except Exception as e:  # noqa: BLE001 (a variant this stack cannot run: say so, go on)
            print(f"{label:>36}  {type(e).__name__}: {str(e)[:160]}", flush=True)
            results.append(dict(variant=label, error=f"{type(e).__name__}: {e}"))
            continue
        if ref is None:
            ref, base = out, us
        err = (out - ref).abs().max().item()
        ok = math.isfinite(err)
        results.append(dict(variant=label, linear=kern, pdl=pdl, linear_prefetch=lpf, mlp_prefetch=mpf,
                            norm_pdl=npdl and inductor_pdl(), us=us,
                            vs_served=base / us, floor_us=floor_us, max_abs_diff=err if ok else None))
        print(f"{label:>36} {us:>9.2f} {base / us:>9.3f} {floor_us / us:>8.2f} {err:>9.2e}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(rows=m, layers=L, keys=c.keys, floor_us=floor_us, inductor_pdl=inductor_pdl(),
                           results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
