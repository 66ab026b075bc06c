"""Where a pure decode step's time goes: graphs on vs off, in one process, on the same state.

An engine serves the first 32 requests of the mixed draw until all 32 rows decode; then N engine steps (real ones:
tokens advance) are timed with host timers around each part of `Engine.step` and CUDA events around the device
work, and one more window runs under torch's profiler (top ops by device and host time to --out).

    python -m scripts.probes.profile_decode --model qwen2.5-1.5b-random --device cuda --steps 50 --out results/profile

Parts: schedule (the scheduler's plan), pack (host lists to device tensors: the static buffer's fill for graphs,
`build` eagerly), launch (graph replay or the eager forward's launches, until the host is free), wait+sample (the
device finishing, argmax and the one readback), apply+finish (bookkeeping after the readback).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import Engine, lineage_config
from engine.dtypes import torch_dtype
from engine.scheduler import StepKind
from engine.graphs import DecodeGraphs
from engine.loader import load_model
from engine.request import State
from engine.readback import Sampled
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine.workload import MIXED, MIXED_CPU


class Timers:
    def __init__(self):
        self.t: dict[str, list[float]] = {}
        self.on = False

    def wrap(self, owner, name, part):
        fn = getattr(owner, name)
        timers = self

        def wrapped(*a, **kw):
            if not timers.on:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers.t.setdefault(part, []).append(time.perf_counter() - t)
        setattr(owner, name, wrapped)
        return fn

    def median_ms(self, part):
        xs = self.t.get(part, [])
        return statistics.median(xs) * 1e3 if xs else 0.0


def state(args, loaded, graphs: bool) -> Engine:
    wl = MIXED if args.model != "small" else MIXED_CPU
    cfg = lineage_config(args.engine, device=args.device, dtype=args.dtype, max_batch=32, chunk_tokens=1024,
                         cuda_graphs=graphs, num_pages=None)
    e = Engine(cfg, loaded=loaded)
    for s in wl.requests(e.shape.vocab_size)[:32]:
        e.submit(s.prompt, min(s.budget + 4 * args.steps + 64, e.max_model_len - len(s.prompt)), s.request_id)
    while e.scheduler.waiting or any(r.state is not State.DECODE for r in e.scheduler.running):
        e.step()
    return e


def measure(e: Engine, steps: int, timers: Timers) -> dict:
    sync = lambda: torch.cuda.synchronize() if e.runner.device.type == "cuda" else None  # noqa: E731
    for _ in range(5):
        e.step()
    sync()
    timers.t.clear()
    timers.on = True
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        rec = e.step()
        walls.append(time.perf_counter() - t)
        assert rec.kind == StepKind.PURE_DECODE, rec
    timers.on = False
    parts = {p: timers.median_ms(p) for p in ("schedule", "pack", "run", "sample", "finish")}
    return dict(step_ms=statistics.median(walls) * 1e3, **parts)


def profile(e: Engine, steps: int, out: Path, tag: str) -> None:
    from torch.profiler import ProfilerActivity, profile as prof
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if e.runner.device.type == "cuda" else [])
    with prof(activities=acts) as p:
        for _ in range(steps):
            e.step()
    key = "self_cuda_time_total" if e.runner.device.type == "cuda" else "self_cpu_time_total"
    (out / f"profile-{tag}.txt").write_text(
        p.key_averages().table(sort_by=key, row_limit=25) + "\n\n" +
        p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.profile_decode", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--engine", default="flash")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", default="results/profile")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(None if a.model == "small" else a.model, torch_dtype(a.dtype), a.device)
    timers = Timers()
    timers.wrap(Scheduler, "schedule", "schedule")
    timers.wrap(DecodeGraphs, "fill", "pack")
    timers.wrap(ModelRunner, "build", "pack")
    timers.wrap(ModelRunner, "launch", "run")         # pack + launch + queue the sampling
    timers.wrap(ModelRunner, "launch_ahead", "run")   # the same for a step launched ahead (overlap)
    timers.wrap(Sampled, "result", "sample")          # the readback: includes waiting for the device
    timers.wrap(Scheduler, "finish_step", "finish")
    rows = {}
    # off CUDA there is nothing to capture: the eager half alone (a check that the script runs)
    for graphs in ((False, True) if a.device.startswith("cuda") else (False,)):
        tag = "graphs" if graphs else "eager"
        e = state(a, loaded, graphs)
        rows[tag] = measure(e, a.steps, timers)
        profile(e, min(a.steps, 20), out, tag)
        del e
        torch.cuda.empty_cache() if a.device.startswith("cuda") else None
    (out / "profile.json").write_text(json.dumps(rows, indent=2))
    print(f"pure decode step, 32 rows, {a.model} {a.engine} {a.dtype}: median ms over {a.steps} engine steps")
    print(f"{'':8} {'step':>8} {'schedule':>9} {'run':>8} {'pack':>8} {'sample':>8} {'finish':>8}")
    for tag, r in rows.items():
        print(f"{tag:8} {r['step_ms']:8.3f} {r['schedule']:9.3f} {r['run']:8.3f} {r['pack']:8.3f} "
              f"{r['sample']:8.3f} {r['finish']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
