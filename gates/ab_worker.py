"""One side of an A/B run (gates/ab.py): a process that times steps of ONE revision's engine, kept alive across
rounds so that the model load, the fixed state and graph capture are paid once.

Run by path, never as `-m gates.ab_worker`: the revision under test (`--tree`) goes first on sys.path, so `engine`
and `gates.step_states` are that revision's, and this file may be newer than them (the base revision need not
contain it). It uses only what gates/step_states.py and engine/ have offered since the step timings began
(States, FixedState, ModelCase, step_fn; LINEAGE, WORKLOADS, WORK_KINDS).

Protocol: JSON lines. This process writes {"ready": info} once its steps are built and warm, then answers each
{"cmd": "run", "reps": N} with {"times": {"wall": {bench: [seconds, ...]}, "cpu": {...}}} (every benchmark N times,
in the given order; each step on both clocks), and ends on {"cmd": "quit"} or end of input. A failure is
{"error": message}, then exit 1. Anything the engine prints goes to stderr (the side's log), so stdout carries the
protocol only.

The fractional plant (`--plant-frac F`, tests and scripts/h200_ab.sh only): inside every timed step, after the
step's work, a busy-wait of F times the time that work just took (on `--clock`), so each step is F slower whatever
the host's load at that moment. A busy-wait, not a sleep: sleeping 0.1 ms
overshoots by as much again on Linux. The revision's own seam (STEPGATE_PLANT_SLOWDOWN_MS, a sleep) works as ever.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback


CLOCKS = ("wall", "cpu")     # wall: time.perf_counter; cpu: this process's CPU time (time.process_time)


def busy_wait(seconds: float) -> None:
    """Spin until both clocks moved by `seconds`: the plant is then exact in CPU time and at least that in wall
    time, whichever clock decides."""
    end_wall, end_cpu = time.perf_counter() + seconds, time.process_time() + seconds
    while time.perf_counter() < end_wall or time.process_time() < end_cpu:
        pass


def parse(argv):
    ap = argparse.ArgumentParser(prog="ab_worker.py")
    ap.add_argument("--tree", required=True, help="the checkout whose engine is timed")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float16 on cuda, float32 on cpu")
    ap.add_argument("--model", default="small")
    ap.add_argument("--workload", default=None, help="a name of engine.workload.WORKLOADS (default: as the step "
                                                     "timings: mixed on cuda for a large model, mixed-cpu else)")
    ap.add_argument("--rows", type=int, default=None, help="decode rows of the fixed state (default: its own, 32)")
    ap.add_argument("--bench", action="append", required=True,
                    help="CONFIG:KIND or CONFIG:KIND:eager (an engine configuration of LINEAGE, a step kind)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--pin", default="", help="CPU cores to run on, comma separated (default: any)")
    ap.add_argument("--plant-frac", type=float, default=0.0)
    ap.add_argument("--clock", choices=CLOCKS, default="wall", help="the clock a plant's share is taken on")
    return ap.parse_args(argv)


def import_tree(tree: str):
    """Put the revision's checkout first on the path and check that its engine is the one imported."""
    tree = os.path.realpath(tree)
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [tree] + [p for p in sys.path if p and os.path.realpath(p) != here]
    import engine
    got = os.path.realpath(engine.__file__)
    if not got.startswith(tree + os.sep):
        raise RuntimeError(f"imported engine from {got}, not from the tree under test {tree} (an installed stepgate "
                           f"shadowing it?)")
    return tree


def build(a):
    import torch
    from engine.config import LINEAGE, lineage_layers
    from engine.scheduler import WORK_KINDS
    from engine.workload import WORKLOADS
    from gates.step_states import FixedState, ModelCase, States, model_label

    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = a.device.startswith("cuda")
    dtype = a.dtype or ("float16" if cuda else "float32")
    small = a.model in ("small", "small-trained")
    wl_name = a.workload or ("mixed" if cuda and not small else "mixed-cpu")
    if wl_name not in WORKLOADS:
        raise ValueError(f"unknown workload {wl_name!r}; this revision knows {sorted(WORKLOADS)}")
    workload = WORKLOADS[wl_name]
    if a.rows and a.rows > workload.num_requests:   # the draw's first `rows` prompts, as bench.profile_steps takes them
        workload = workload.scaled(a.rows)
    case = ModelCase(a.model, workload)
    states = States(a.device, dtype)
    kinds = [str(k) for k in WORK_KINDS]
    benches, fixed = {}, {}
    for spec in a.bench:
        parts = spec.split(":")
        if len(parts) not in (2, 3) or parts[0] not in LINEAGE or parts[1] not in kinds or parts[2:] not in (
                [], ["eager"]):
            raise ValueError(f"--bench {spec!r}: want CONFIG:KIND[:eager], CONFIG one of {sorted(LINEAGE)}, "
                             f"KIND one of {kinds}")
        name, kind = parts[0], parts[1]
        graphs = parts[2:] != ["eager"]
        base = LINEAGE[name]
        key = (base["backend"], base["page_size"], tuple(sorted(lineage_layers(name).items())))
        if key not in fixed:      # one fixed state per (backend, page size, layers), as States.get keeps them
            if a.rows:
                fixed[key] = FixedState(case, name, base["backend"], base["page_size"], a.device, dtype,
                                        states.loaded(a.model), rows=a.rows)
            else:
                fixed[key] = states.get(case, name)
        st = fixed[key]
        fn = st.step_fn(kind, base["forward"], graphs=graphs)
        benches[spec] = dict(fn=fn, describe=dict(st.describe(kind), engine=name, kind=kind, graphs=graphs,
                                                  model=model_label(a.model), device=a.device, dtype=dtype))
    info = dict(tree=a.tree, torch=torch.__version__, device=a.device, dtype=dtype, threads=torch.get_num_threads(),
                workload=wl_name, device_name=torch.cuda.get_device_name(a.device) if cuda else "cpu")
    return benches, info


def time_calls(fn, n: int, plant_frac: float = 0.0, clock: str = "wall") -> dict[str, list[float]]:
    """Each call's wall time and CPU time (seconds). A plant extends each step by `plant_frac` of that step's own
    time on `clock`, inside the timing."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        if plant_frac:
            busy_wait(plant_frac * (time.perf_counter() - t if clock == "wall" else time.process_time() - c))
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - t)
    return {"wall": wall, "cpu": cpu}


def serve(a, proto) -> None:
    benches, info = build(a)
    # pinned after the build, before the warm-up: the timed steps share the core, and the builds (the most of a
    # start) of several processes starting at once are not queued on that one core
    if a.pin:
        os.sched_setaffinity(0, {int(c) for c in a.pin.split(",")})
    for b in benches.values():
        time_calls(b["fn"], a.warmup)
    info.update(benchmarks={s: b["describe"] for s, b in benches.items()}, plant_frac=a.plant_frac, clock=a.clock)
    gc.collect()        # once: a full collection costs tenths of a second here, too much for every round
    send(proto, {"ready": info})
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("cmd") == "quit":
            return
        if msg.get("cmd") != "run":
            raise ValueError(f"unknown command {msg!r}")
        reps = int(msg["reps"])
        times = {c: {} for c in CLOCKS}
        gc.disable()        # a collection inside one side's round would be noise that only that side pays
        try:
            for spec, b in benches.items():
                for clock, t in time_calls(b["fn"], reps, a.plant_frac, a.clock).items():
                    times[clock][spec] = t
        finally:
            gc.enable()
        send(proto, {"times": times})


def send(proto, msg: dict) -> None:
    proto.write(json.dumps(msg) + "\n")
    proto.flush()


def main(argv=None) -> int:
    a = parse(argv)
    # the protocol keeps the real stdout; fd 1 (Python's and C's prints) goes to stderr, the side's log
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        import_tree(a.tree)
        serve(a, proto)
    except Exception as e:
        traceback.print_exc()
        send(proto, {"error": f"{type(e).__name__}: {e}"})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
