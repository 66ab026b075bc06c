"""Where each step kind's device time goes: the step bench's fixed state, kernels by device time per step.

The fixed state of the step timings (gates/step_states.py: `rows` decoding requests of the mixed draw and one
request half way through a two-chunk prompt) runs each step kind (pure decode, loaded, chunk-only) N times, captured
where the engine captures it; the median wall time per step is printed beside the device time per step from torch's
profiler, by kernel family (GEMM, attention, compiled pointwise, copies) and the top kernels. A wall time well above
the device time means the host sets the pace; the families say which kernels to work on otherwise.

    python -m bench.profile_steps --model qwen2.5-1.5b-random --device cuda --rows 32 --out results/profile_steps.json
    python -m bench.profile_steps --rows 512 --chunk 16384      # the 512-row serving bench's loaded step
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from engine.config import LINEAGE
from engine.scheduler import WORK_KINDS
from engine.workload import MIXED

# attention first: flash-attn's kernel names carry cutlass types; attend_items and combine_items: kernels/triton_decode;
# gate_up_silu: kernels/mlp.py's GEMM with its SiLU-mul (until session 33 it fell under "other")
FAMILIES = (("attention", r"flash|attn|fmha|attend_items|combine_items"),
            ("gemm", r"nvjet|gemm|cutlass|xmma|cublas|^gate_up_silu$|^aten::(mm|addmm|bmm)$"),
            ("pointwise (compiled)", r"^triton_"), ("copy / index", r"copy|index|gather|scatter|memcpy|memset|cat"))


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.I):
            return fam
    return "other"


def kernels_per_step(step, steps: int, cuda: bool) -> dict[str, float]:
    """Microseconds per step by kernel name, from torch's profiler over `steps` runs of `step` (the step
    synchronises the device itself). Without CUDA: the CPU ops' self time, so the tool runs (and is tested) on CPU."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
    per: dict[str, float] = {}
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0 and (not cuda or e.device_type == torch.autograd.DeviceType.CUDA):
            per[e.key] = per.get(e.key, 0.0) + us / steps
    return per


def by_family(per_kernel: dict[str, float]) -> dict[str, float]:
    """Kernel times summed by family, the largest first."""
    fams: dict[str, float] = {}
    for name, t in per_kernel.items():
        fams[family(name)] = fams.get(family(name), 0.0) + t
    return dict(sorted(fams.items(), key=lambda kv: -kv[1]))


def engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The model, device, dtype and engine configuration a profile runs (this and scripts.probes.profile_trace)."""
    ap.add_argument("--model", default="qwen2.5-1.5b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--engine", default="flash", choices=sorted(LINEAGE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.profile_steps", description=__doc__.splitlines()[0])
    engine_arguments(ap)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=None,
                    help="prompt positions of the loaded and chunk-only steps (default: the mixed draw's 512)")
    ap.add_argument("--kinds", default=",".join(str(k) for k in WORK_KINDS))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--graphs", default="on", choices=("on", "off"))
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from gates.step_states import FixedState, ModelCase, States, captured
    states = States(a.device, a.dtype)
    base = LINEAGE[a.engine]
    workload = MIXED.scaled(max(a.rows, 32))
    if a.chunk:
        workload = dataclasses.replace(workload, chunk_tokens=a.chunk)
    st = FixedState(ModelCase(a.model, workload), a.engine, base["backend"], base["page_size"], a.device,
                    a.dtype, states.loaded(a.model), rows=a.rows)
    report = dict(model=a.model, engine=a.engine, rows=a.rows, chunk=workload.chunk_tokens, graphs=a.graphs,
                  kinds={})
    for kind in a.kinds.split(","):
        step = st.step_fn(kind, base["forward"], graphs=a.graphs == "on")
        for _ in range(3):
            step()
        wall = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            wall.append((time.perf_counter() - t0) * 1e3)
        per = kernels_per_step(step, a.steps, torch.device(a.device).type == "cuda")
        fams = by_family(per)
        top = sorted(per.items(), key=lambda kv: -kv[1])[:a.top]
        report["kinds"][kind] = dict(describe=st.describe(kind), captured=captured(st.engine.runner, kind) is not None
                                     and a.graphs == "on", wall_ms_median=statistics.median(wall),
                                     device_ms=sum(per.values()) / 1e3,
                                     families_ms={f: us / 1e3 for f, us in fams.items()},
                                     top_us=dict(top))
    for kind, r in report["kinds"].items():
        d = r["describe"]
        print(f"\n{kind}: {d['rows']} decode rows, {d['prompt_positions']} prompt positions, captured={r['captured']}: "
              f"wall {r['wall_ms_median']:.3f} ms, device {r['device_ms']:.3f} ms a step")
        print("  " + "; ".join(f"{f} {ms:.3f} ms" for f, ms in r["families_ms"].items()))
        for name, us in r["top_us"].items():
            print(f"  {us:9.1f} us  {name[:110]}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
