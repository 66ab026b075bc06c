"""Where a gate run's host time goes: one engine configuration serves a gate workload as the gates serve it (poison
mode, the schedule log kept, top-k recorded: gates/reference.EngineReference), once to warm up (compiles), then again
under cProfile; prints steps, wall time per step and the top functions by own time.

Why: on the H200 the GPU gate suite's time is mostly the eager reference engines' steps (6-8 ms a step on the
4-layer small model, host-bound: docs/RESULTS.md g15), and a whole-suite cProfile also counts compiles, imports and
the checks; this profiles the runs alone, per configuration.

    python -m scripts.probes.gate_run_profile --device cuda --configs chunked:torch,fused:torch,fused:flex,flash:flash
    python -m scripts.probes.gate_run_profile --device cpu --configs fused:torch --top 15     # a smoke run
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from engine.dtypes import torch_dtype
from engine.loader import load_model
from engine.workload import get_workload
from gates.reference import EngineReference


def profile_run(engine: str, backend: str, workload: str, device: str, dtype: str, loaded, top: int,
                overrides: dict | None = None, kernels: bool = False) -> str:
    wl = get_workload(workload)
    ref = EngineReference(engine, device=device, dtype=dtype, loaded=loaded, backend=backend, poison=True,
                          chunk_tokens=wl.chunk_tokens, **(overrides or {}))
    t0 = time.perf_counter()
    ref.generate(wl.requests())                      # warm-up: compiles, captures
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref.generate(wl.requests())                      # unprofiled: the run's own time
    plain = time.perf_counter() - t0
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    ref.generate(wl.requests())
    prof.disable()
    wall = time.perf_counter() - t0
    steps = ref.last_engine.scheduler.step_index
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    if kernels:
        out.write(kernel_line(ref, wl, steps))
    given = "".join(f" {k}={v}" for k, v in (overrides or {}).items())
    head = (f"{engine}[{backend}]{given} on {workload} ({device}, {dtype}): first run {warm:.2f} s; then "
            f"{plain:.2f} s, "
            f"{1e3 * plain / max(1, steps):.2f} ms a step; profiled run {wall:.2f} s, {steps} steps, "
            f"{1e3 * wall / max(1, steps):.2f} ms a step (under cProfile)")
    return head + "\n" + out.getvalue()


def kernel_line(ref, wl, steps: int) -> str:
    """One more run under torch.profiler: device kernels launched and their summed device time, per step (host-bound
    when the device time is a small share of the step's wall time)."""
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ref.generate(wl.requests())
    wall = time.perf_counter() - t0
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in events) / 1e3          # us -> ms
    ops = sum(1 for e in prof.events() if e.device_type.name == "CPU" and e.cpu_parent is None)
    return (f"under torch.profiler: {wall / steps * 1e3:.2f} ms a step wall; {len(events) / steps:.0f} device kernels "
            f"and copies a step, {busy / steps:.2f} ms of device time a step; {ops / steps:.0f} top-level torch ops a "
            f"step\n")


def parse_set(kv: str) -> tuple[str, object]:
    name, _, value = kv.partition("=")
    low = value.lower()
    if low in ("true", "false"):
        return name, low == "true"
    if low == "none":
        return name, None
    try:
        return name, int(value)
    except ValueError:
        return name, value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.gate_run_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-trained")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 elsewhere")
    ap.add_argument("--workload", default="mixed-cpu")
    ap.add_argument("--configs", default="chunked:torch,fused:torch,fused:flex,flash:flash",
                    help="engine:backend pairs, comma-separated")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="an EngineConfig override for every configuration (true/false/none/int), repeatable")
    ap.add_argument("--kernels", action="store_true", help="one more run under torch.profiler: kernels a step")
    a = ap.parse_args(argv)
    overrides = dict(parse_set(kv) for kv in a.set)
    dtype = a.dtype or ("float16" if a.device.startswith("cuda") else "float32")
    loaded = load_model(a.model, torch_dtype(dtype), a.device)
    for pair in a.configs.split(","):
        engine, backend = pair.split(":")
        print(profile_run(engine, backend, a.workload, a.device, dtype, loaded, a.top, overrides, a.kernels),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
