"""Where a captured step's wall time goes beyond its kernels: the step bench's step (`runner.run`, the device
synchronised around it) cut into the host's packing before the replay, the replayed graph (host wall and CUDA-event
time) and the sampling after it. The profiler's device time sums kernel durations; the graph's event time adds the
gaps between its kernels; the step bench adds the host's work before the launch and the readback after it.

    python -m scripts.probes.step_wall --model qwen2.5-1.5b-random --rows 32 --out results/step_wall.json
    python -m scripts.probes.step_wall --profile 25      # and the host's work before the launch under cProfile
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import torch

from engine.config import LINEAGE
from engine.workload import MIXED


def median_ms(fn, reps: int, before=None) -> float:
    """Median wall ms of fn(); `before` runs untimed ahead of each call (a wait for the device's earlier work)."""
    out = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m scripts.probes.step_wall", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-1.5b-random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--engine", default="flash", choices=sorted(LINEAGE))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--kinds", default="pure-decode,loaded")
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", type=int, default=0,
                    help="print the top N functions by own time (cProfile) of the host's work before the launch")
    a = ap.parse_args(argv)
    from gates.step_states import FixedState, ModelCase, States
    states = States(a.device, a.dtype)
    base = LINEAGE[a.engine]
    st = FixedState(ModelCase(a.model, MIXED.scaled(max(a.rows, 32))), a.engine, base["backend"], base["page_size"],
                    a.device, a.dtype, states.loaded(a.model), rows=a.rows)
    runner, owned, mode = st.engine.runner, st.engine.pool.owned, base["forward"]
    sync = torch.cuda.synchronize
    report = {}
    for kind in a.kinds.split(","):
        plan = st.plan(kind)
        for _ in range(5):
            runner.run(plan, owned, mode)
        sync()

        def full():
            sync()
            runner.run(plan, owned, mode)

        def pre_and_graph():
            sync()
            runner.logits(plan, owned, mode)
            sync()

        runner.logits(plan, owned, mode)
        sync()
        sets = runner.graphs if not plan.chunks else runner.step_graphs
        graph = sets.graphs[sets.last_key]

        def graph_only():
            sync()
            graph.replay()
            sync()

        def host_pre():      # the packing and the launch, not waited for (the wait before it is not timed)
            runner.logits(plan, owned, mode)

        logits = runner.logits(plan, owned, mode)
        sync()

        def tail():
            sync()
            runner.sample_async(logits).result()

        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        dev = []
        for _ in range(a.reps):
            sync()
            ev[0].record()
            graph.replay()
            ev[1].record()
            sync()
            dev.append(ev[0].elapsed_time(ev[1]))
        r = dict(full=median_ms(full, a.reps), pre_and_graph=median_ms(pre_and_graph, a.reps),
                 graph_host=median_ms(graph_only, a.reps), graph_events=statistics.median(dev),
                 host_pre_launch=median_ms(host_pre, a.reps, before=sync), sample_tail=median_ms(tail, a.reps))
        sync()
        report[kind] = r
        print(f"{kind}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in r.items()), flush=True)
        if a.profile:
            prof = cProfile.Profile()
            for _ in range(a.reps):
                sync()
                prof.enable()
                runner.logits(plan, owned, mode)
                prof.disable()
            sync()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.profile)
            print(f"{kind}: host before the launch, {a.reps} steps under cProfile\n{text.getvalue()}", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(dict(model=a.model, rows=a.rows, kinds=report), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
