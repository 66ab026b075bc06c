"""Where a serving run's steps spend device time: the closed mixed workload served twice on one engine, the second
pass stepped one step at a time (steps launched ahead off, so each profile holds its own step's kernels only), each
step's kernels summed by family (bench/profile_steps.py's families), then a summary per step kind.

bench/profile_steps.py profiles one fixed state; this profiles the steps the serving bench really takes (the
512-row run's loaded steps carry several whole prompts, where the step bench's 512-row state has one chunk after
16,383 cached positions: attention 21 ms against 249 ms of its step on the H200).

    python -m scripts.probes.profile_trace --model qwen2.5-1.5b-random --device cuda --rows 512 --chunk 16384 \\
        --out results/profile_trace_r512.json
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
from engine.workload import MIXED

from bench.profile_steps import by_family, engine_arguments, kernels_per_step


def profile_steps_of_run(engine: Engine, specs, max_steps: int, cuda: bool) -> list[dict]:
    """Submit `specs` and take up to `max_steps` steps, each profiled alone: its kind, prompt positions, decode rows,
    wall ms (synchronised) and device ms by kernel family (on CPU: the ops' self time)."""
    for s in specs:
        engine.submit(s.prompt, s.budget, s.request_id)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rows = []
    while engine.scheduler.has_work and len(rows) < max_steps:
        took = {}

        def step():
            t0 = time.perf_counter()
            took["rec"] = engine.step()
            sync()
            took["wall"] = (time.perf_counter() - t0) * 1e3
        per = kernels_per_step(step, 1, cuda)
        fams = {f: us / 1e3 for f, us in by_family(per).items()}
        rec = took["rec"]
        rows.append(dict(index=len(rows), kind=str(rec.kind), prompt_positions=rec.prompt_positions,
                         decode_rows=rec.decode_tokens, wall_ms=took["wall"], device_ms=sum(fams.values()),
                         families_ms=fams, kernels_us=per))
    return rows


def by_kind(rows: list[dict], top: int = 10) -> dict[str, dict]:
    """Per step kind: steps, median wall and device ms, each family's median ms, and the `top` kernels by their
    total over the kind's steps (ms)."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        fams = dict.fromkeys(f for r in mine for f in r["families_ms"])
        total: dict[str, float] = {}
        for r in mine:
            for name, us in r.get("kernels_us", {}).items():
                total[name] = total.get(name, 0.0) + us / 1e3
        out[kind] = dict(steps=len(mine), wall_ms_median=statistics.median(r["wall_ms"] for r in mine),
                         device_ms_median=statistics.median(r["device_ms"] for r in mine),
                         families_ms_median={f: statistics.median(r["families_ms"].get(f, 0.0) for r in mine)
                                             for f in fams},
                         top_kernels_ms_total=dict(sorted(total.items(), key=lambda kv: -kv[1])[:top]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.profile_trace", description=__doc__.splitlines()[0])
    engine_arguments(ap)
    ap.add_argument("--rows", type=int, default=32, help="max_batch")
    ap.add_argument("--chunk", type=int, default=512, help="the chunk budget")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40, help="steps of the second pass to profile (from its first)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = torch.device(a.device).type == "cuda"
    cfg = lineage_config(a.engine, device=a.device, dtype=a.dtype, max_batch=a.rows, chunk_tokens=a.chunk,
                         progress=False, prefix_cache=False, overlap=False)
    engine = Engine(cfg, model=a.model)
    specs = MIXED.scaled(a.requests).with_budget(a.new_tokens).requests()
    engine.run(specs)                       # warm: every bucket and width this workload uses, compiled and captured
    again = [type(s)(f"{s.request_id}-profiled", s.prompt, s.budget) for s in specs]
    rows = profile_steps_of_run(engine, again, a.steps, cuda)
    report = dict(model=a.model, engine=a.engine, rows=a.rows, chunk=a.chunk, requests=a.requests,
                  new_tokens=a.new_tokens, steps=rows, kinds=by_kind(rows))
    for kind, k in report["kinds"].items():
        print(f"{kind}: {k['steps']} steps, median wall {k['wall_ms_median']:.2f} ms, device "
              f"{k['device_ms_median']:.2f} ms: " + "; ".join(f"{f} {ms:.2f}" for f, ms in
                                                            k["families_ms_median"].items()))
        for name, ms in k["top_kernels_ms_total"].items():
            print(f"    {ms:9.2f} ms  {name[:110]}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
