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


def profile_run(engine: str, backend: str, workload: str, device: str, dtype: str, loaded, top: int) -> str:
    wl = get_workload(workload)
    ref = EngineReference(engine, device=device, dtype=dtype, loaded=loaded, backend=backend, poison=True,
                          chunk_tokens=wl.chunk_tokens)
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
    head = (f"{engine}[{backend}] on {workload} ({device}, {dtype}): first run {warm:.2f} s; then {plain:.2f} s, "
            f"{1e3 * plain / max(1, steps):.2f} ms a step; profiled run {wall:.2f} s, {steps} steps, "
            f"{1e3 * wall / max(1, steps):.2f} ms a step (under cProfile)")
    return head + "\n" + out.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.gate_run_profile", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-trained")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: float16 on CUDA, float32 elsewhere")
    ap.add_argument("--workload", default="mixed-cpu")
    ap.add_argument("--configs", default="chunked:torch,fused:torch,fused:flex,flash:flash",
                    help="engine:backend pairs, comma-separated")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    dtype = a.dtype or ("float16" if a.device.startswith("cuda") else "float32")
    loaded = load_model(a.model, torch_dtype(dtype), a.device)
    for pair in a.configs.split(","):
        engine, backend = pair.split(":")
        print(profile_run(engine, backend, a.workload, a.device, dtype, loaded, a.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
