"""Performance regressions decided on one machine in one job: the base revision and head, each in processes of its
own (--processes pairs of them: a process has a speed of its own), their step timings taken in interleaved rounds
(base, head, base, head, ...: a drift of the host lands on both), and a verdict per benchmark with a confidence
interval over the pairs (gates/ab_stats.py).

    python -m gates.ab --base origin/main --merge-base --device cuda      # a pull request against its merge base
    python -m gates.ab --base HEAD --device cpu                           # A/A: head against itself
    python -m gates.ab --base HEAD --plant-head-frac 0.1                  # head planted 10% slower: must alert
    python -m gates.ab refresh-baseline --storage golden/benchmarks/h200 --device cuda   # history, not alerts

The base revision is checked out into a temporary git worktree (or given as a checkout, --base-tree); head is this
checkout, uncommitted changes included. Each side is timed by gates/ab_worker.py run with that side's tree first on
the path, so the base needs none of this file's code. The checkout is gates/ab_tree.py's, the processes and their
rounds gates/ab_rounds.py's; this file decides on the rounds and holds the command line. Writes to --out: ab.md
(also appended to $GITHUB_STEP_SUMMARY when set), ab.json (every round's timings), ab.png (the rounds), and each
process's log (base-1.log, head-1.log, base-2.log, ...).
Exit status: 0 no regression, 1 a regression, 2 the run could not be made (a revision, a worker, the deadline).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import ab_report
from .ab_stats import CONFIDENCE, REGRESSION, RESAMPLES, SEED, compare, threshold_for
from .ab_rounds import CLOCKS, Side, measure_pairs
from .ab_tree import REPO, ABError, base_checkout, describe_tree

# engine.scheduler.WORK_KINDS' names, written out: the driver imports no torch (engine/ does); the worker checks
# every kind it is given against its own revision's WORK_KINDS
KINDS = ("pure-decode", "loaded", "chunk-only")
M15 = "qwen2.5-1.5b-random"
# (rounds, steps a side per round and benchmark, warm-up steps) per device kind. Rounds are short and many: a
# neighbour's load on a shared host comes and goes within a second (on the 2-core CPU host a 7 ms step read 5 to 15 ms
# from one second to the next), so base and head must alternate faster than that to see the same host; and the
# interval is resampled from rounds, so more rounds make it tighter.
DEFAULTS = {"cuda": (100, 10, 20), "cpu": (40, 5, 5)}
# Process pairs per device kind: a process has a speed of its own (on the H200 an A/A pair of processes read 1.041x
# for 100 rounds, another 0.995x), and only fresh processes sample it. Each pair costs a start (cuda: model load and
# graph capture, about 40 s for a pair on the H200, overlapping when pairs start together). On the CPU host a pair's
# A/A ratio stayed within 0.98-1.031x (docs/ab.md), under its 5% threshold, and each process adds a start of 7 s or
# more on its 2 cores, so one pair keeps the CPU run short. cuda 5: three pairs' A/A estimates spread 0.962-1.008x
# over seven runs (docs/ab.md), about as far as a 5% plant's 1.043-1.062x; five pairs shrink that spread by a
# quarter at about 10 s more start (the pairs start together).
PROCESSES = {"cuda": 5, "cpu": 1}


# -- the run -------------------------------------------------------------------------------------------------------
def bench_specs(a) -> list[str]:
    if a.bench:
        return list(a.bench)
    configs = a.config or ["flash" if a.device.startswith("cuda") else "fused"]
    kinds = a.kinds.split(",") if a.kinds else list(KINDS)
    return [f"{c}:{k}" for c in configs for k in kinds]


def bench_name(spec: str, device: str, model: str) -> str:
    """As gates/test_step_timings.py names its benchmarks: DEVICE-MODEL-CONFIG-KIND[-eager]."""
    dev = device.split(":")[0]
    return f"{dev}-{os.path.basename(model.rstrip('/')) or model}-" + spec.replace(":", "-")


def worker_args(a, specs: list[str]) -> list[str]:
    out = ["--device", a.device, "--model", a.model, "--warmup", str(a.warmup), "--threads", str(a.threads),
           "--clock", a.clock]
    for flag, v in (("--dtype", a.dtype), ("--workload", a.workload), ("--rows", a.rows), ("--pin", a.pin)):
        if v:
            out += [flag, str(v)]
    for s in specs:
        out += ["--bench", s]
    return out


def config_notes(base: dict, head: dict) -> list[str]:
    """Where the two sides' fixed states differ (a changed workload or state makes the steps different work)."""
    notes = []
    for spec, d in base["benchmarks"].items():
        h = head["benchmarks"].get(spec, {})
        diff = [f"{k} {d[k]!r} -> {h[k]!r}" for k in sorted(d.keys() & h.keys()) if d[k] != h[k]]
        if diff:
            notes.append(f"{spec}: the state differs between base and head: " + ", ".join(diff))
    for k in ("torch", "device_name", "dtype", "threads"):
        if base.get(k) != head.get(k):
            notes.append(f"{k}: base {base.get(k)!r}, head {head.get(k)!r}")
    return notes



def ab(a) -> dict:
    """One A/B run from the parsed command line; returns the record (also written under a.out)."""
    t_start = time.monotonic()
    deadline = t_start + a.deadline
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev_kind = a.device.split(":")[0]
    threshold = a.threshold if a.threshold is not None else threshold_for(dev_kind)
    specs = bench_specs(a)
    head_tree = Path(a.head_tree).resolve()
    base_meta = {"rev": "checkout" if a.base_tree else a.base}
    with base_checkout(a, base_meta) as base_tree:
        base_meta.update(tree=str(base_tree), **({} if base_meta.get("commit") else describe_tree(base_tree)))
        head_meta = dict(rev="HEAD", tree=str(head_tree), **describe_tree(head_tree))
        plant_env = {}
        head_args = worker_args(a, specs)
        if a.plant_head_frac:
            head_args += ["--plant-frac", str(a.plant_head_frac)]
            head_meta["plant"] = f"{a.plant_head_frac * 100:g}% busy-wait"
        if a.plant_head_ms:
            plant_env["STEPGATE_PLANT_SLOWDOWN_MS"] = str(a.plant_head_ms)
            head_meta["plant"] = (head_meta.get("plant", "") + f" {a.plant_head_ms:g} ms sleep").strip()
        sets = [dict(base=Side(f"base-{p}", base_tree, worker_args(a, specs), out / f"base-{p}.log"),
                     head=Side(f"head-{p}", head_tree, head_args, out / f"head-{p}.log", plant_env))
                for p in range(1, a.processes + 1)]
        timings, pairs, info, notes = measure_pairs(sets, specs, a.rounds, a.reps, deadline, a.startup_timeout,
                                                    a.successive, progress=(lambda *_: None) if a.quiet else print)
    record = decide(timings["base"], timings["head"], specs, info["base"], info["head"],
                    dict(base=base_meta, head=head_meta, device=a.device, model=a.model, clock=a.clock,
                         threshold=threshold, confidence=a.confidence, resamples=a.resamples, seed=a.seed,
                         reps=a.reps, warmup=a.warmup, processes=a.processes, successive=a.successive), notes,
                    pairs)
    record["seconds"] = time.monotonic() - t_start
    write(record, out, plot=not a.no_plot)
    return record


def decide(base: dict, head: dict, specs: list[str], base_info: dict, head_info: dict, run: dict,
           notes: list[str] = (), pairs: list[int] | None = None) -> dict:
    """The record of one A/B run: per benchmark the medians, the ratio with its interval and the verdict, on the
    run's clock. base / head: {clock: {spec: [round's timings, ...]}}, as measure_pairs() gives them; pairs: the
    process pair of each round (default: one pair); `run`: what the record says about the run (sides, device,
    model, clock, threshold, confidence, resamples, seed, reps)."""
    clock = run["clock"]
    done = len(base[clock][specs[0]])
    if done < 3:
        raise ABError(f"only {done} round(s) measured before the deadline: no interval from that; raise --deadline "
                      f"or lower --rounds/--reps")
    pairs = list(pairs) if pairs is not None else [1] * done
    notes = list(notes)
    if run.get("processes", 1) > len(set(pairs)):
        notes.append(f"only {len(set(pairs))} of {run['processes']} process pairs measured before the deadline")
    benches = []
    for spec in specs:
        c = compare(base[clock][spec], head[clock][spec], run["threshold"], run["confidence"], run["resamples"],
                    run["seed"], pairs)
        other = [x for x in CLOCKS if x != clock][0]
        o = compare(base[other][spec], head[other][spec], run["threshold"], run["confidence"], run["resamples"],
                    run["seed"], pairs)
        benches.append(dict(name=bench_name(spec, run["device"], run["model"]), spec=spec, base_median=c.base_median,
                            head_median=c.head_median, ratio=c.ratio, low=c.low, high=c.high, verdict=c.verdict,
                            pair_ratios=list(c.pairs),
                            other_clock=dict(clock=other, ratio=o.ratio, low=o.low, high=o.high),
                            base_rounds=base[clock][spec], head_rounds=head[clock][spec],
                            rounds_by_clock={"base": {x: base[x][spec] for x in CLOCKS},
                                             "head": {x: head[x][spec] for x in CLOCKS}},
                            state=base_info["benchmarks"][spec]))
    record = dict(run, device_kind=run["device"].split(":")[0], device_name=base_info.get("device_name"),
                  rounds=done, pair_of_round=pairs, pairs=len(set(pairs)), threads=base_info.get("threads"),
                  torch=base_info.get("torch"), benchmarks=benches,
                  notes=notes + config_notes(base_info, head_info), seconds=0.0)
    record["regression"] = any(b["verdict"] == REGRESSION for b in benches)
    return record



def write(record: dict, out: Path, plot: bool = True) -> None:
    if plot:
        why = ab_report.plot(record, out / "ab.png")
        if why:
            record["notes"].append(why)
    md = ab_report.markdown(record)
    (out / "ab.md").write_text(md)
    ab_report.write_json(record, out / "ab.json")
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a") as f:
            f.write(md + "\n")


# -- the baseline refresh ------------------------------------------------------------------------------------------
def refresh_baseline(argv: list[str]) -> int:
    """Record this checkout's step timings as a machine's new baseline: pytest-benchmark's own save, into the
    machine's folder, named after the machine and the commit (the commit is also in the file's commit_info)."""
    ap = argparse.ArgumentParser(prog="python -m gates.ab refresh-baseline", description=refresh_baseline.__doc__)
    ap.add_argument("--storage", required=True, help="the machine's folder, e.g. golden/benchmarks/h200")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("-k", dest="select", default=None, help="pytest -k expression (default: every step timing)")
    ap.add_argument("--allow-dirty", action="store_true", help="save although the checkout has uncommitted changes")
    ap.add_argument("--commit", default=None,
                    help="the commit these timings are of, where this copy of the tree has no git history (written "
                         "into the file's commit_info); default: git rev-parse HEAD")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    a = ap.parse_args(argv)
    tree = describe_tree(REPO)
    if a.commit:
        tree = {"commit": a.commit, "dirty": tree["dirty"] if tree["commit"] == a.commit else None}
    if not tree["commit"]:
        print("gates.ab refresh-baseline: no commit to name (not a git checkout): pass --commit", file=sys.stderr)
        return 2
    if tree["dirty"] and not a.allow_dirty:
        print("gates.ab refresh-baseline: the checkout has uncommitted changes; a baseline names a commit "
              "(commit first, or --allow-dirty)", file=sys.stderr)
        return 2
    storage = Path(a.storage.removeprefix("file://")).resolve()
    name = f"{storage.name}_{tree['commit'][:10]}"
    before = set(storage.rglob("*.json")) if storage.is_dir() else set()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pytest", "gates/test_step_timings.py", "--device", a.device, "-q",
               "-p", "no:cacheprovider", f"--benchmark-storage=file://{storage}", f"--benchmark-save={name}",
               "--benchmark-columns=median,iqr,rounds", f"--gate-summary={tmp}/gs.json",
               f"--gate-summary-md={tmp}/gs.md", *(["-k", a.select] if a.select else []), *a.pytest_args]
        print("gates.ab refresh-baseline:", " ".join(cmd), flush=True)
        env = {k: v for k, v in os.environ.items() if k != "GITHUB_STEP_SUMMARY"}
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
    new = sorted(set(storage.rglob("*.json")) - before)
    if rc != 0 or not new:
        print(f"gates.ab refresh-baseline: pytest exited {rc}; {len(new)} baseline file(s) written", file=sys.stderr)
        return 1 if rc else 2
    for p in new:
        data = json.loads(p.read_text())
        ci = data.get("commit_info") or {}
        if ci.get("id") != tree["commit"]:      # a copy of the tree without .git: pytest-benchmark found no commit
            data["commit_info"] = ci = {"id": tree["commit"], "dirty": tree["dirty"], "given": "--commit"}
            p.write_text(json.dumps(data, indent=4))
        print(f"new baseline: {p} ({len(data['benchmarks'])} benchmarks, commit {ci.get('id')}"
              f"{' +uncommitted' if ci.get('dirty') else ''})")
    return 0


# -- the command line ----------------------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m gates.ab", description=__doc__.split("\n\n")[0],
                                 epilog="python -m gates.ab refresh-baseline --help: the baseline refresh")
    ap.add_argument("--base", default="origin/main", help="the base revision (default origin/main)")
    ap.add_argument("--merge-base", action="store_true", help="compare against the merge base of --base and HEAD")
    ap.add_argument("--base-tree", help="an existing checkout to use as the base (instead of a worktree of --base)")
    ap.add_argument("--head-tree", default=str(REPO), help="the head checkout (default: this one)")
    ap.add_argument("--keep-worktree", action="store_true", help="leave the base worktree in place")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--model", default=None, help=f"default: {M15} on cuda, small on cpu")
    ap.add_argument("--workload", default=None, help="the fixed state's workload (default: as the step timings)")
    ap.add_argument("--rows", type=int, default=None, help="decode rows of the fixed state (default 32)")
    ap.add_argument("--config", action="append", help="engine configuration (default: flash on cuda, fused on cpu)")
    ap.add_argument("--kinds", default=None, help=f"step kinds, comma separated (default: {','.join(KINDS)})")
    ap.add_argument("--bench", action="append", help="CONFIG:KIND[:eager], instead of --config/--kinds")
    ap.add_argument("--rounds", type=int, default=None, help="rounds a side in all, spread over the process pairs")
    ap.add_argument("--processes", type=int, default=None,
                    help="process pairs (fresh base and head processes each), the unit the interval resamples "
                         "(default: 3 on cuda, 1 on cpu)")
    ap.add_argument("--successive", action="store_true",
                    help="start each pair after the previous one ended (default: all pairs alive at once, each "
                         "round going through every pair)")
    ap.add_argument("--reps", type=int, default=None, help="steps a side per round and benchmark")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps per benchmark before the first round")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of each side (default: 1 on cpu, where two threads on a shared host are the "
                         "largest noise; torch's own on cuda)")
    ap.add_argument("--pin", default=None,
                    help="CPU cores both sides run on, comma separated (default: on a cpu device, one core, the same "
                         "for both: two processes left to the scheduler settle on different cores, and on a shared "
                         "host one core is busier than the other; 'none': unpinned)")
    ap.add_argument("--threshold", type=float, default=None, help="A/A noise threshold (default per device kind: "
                                                                  "gates/ab_stats.py THRESHOLDS)")
    ap.add_argument("--clock", choices=CLOCKS, default=None,
                    help="what decides: wall time, or the process's CPU time (default: cpu on a cpu device, where a "
                         "neighbour's load stretches wall time but not CPU time; wall on cuda)")
    ap.add_argument("--confidence", type=float, default=CONFIDENCE)
    ap.add_argument("--resamples", type=int, default=RESAMPLES)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--deadline", type=float, default=600, help="seconds for the whole run (default 600)")
    ap.add_argument("--startup-timeout", type=float, default=420, help="seconds for a side to build and warm up")
    ap.add_argument("--plant-head-frac", type=float, default=0.0,
                    help="tests: a busy-wait of this share of each step inside head's timed steps")
    ap.add_argument("--plant-head-ms", type=float, default=0.0,
                    help="tests: head's own plant seam (STEPGATE_PLANT_SLOWDOWN_MS, a sleep in the timed step)")
    ap.add_argument("--out", default="results/ab", help="folder for ab.md, ab.json, ab.png and the logs")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--quiet", action="store_true")
    return ap


def parse(argv: list[str] | None) -> argparse.Namespace:
    a = parser().parse_args(argv)
    cuda = a.device.startswith("cuda")
    rounds, reps, warmup = DEFAULTS["cuda" if cuda else "cpu"]
    a.rounds = a.rounds or rounds
    a.processes = a.processes or PROCESSES["cuda" if cuda else "cpu"]
    a.reps = a.reps or reps
    a.warmup = a.warmup if a.warmup is not None else warmup
    a.threads = a.threads if a.threads is not None else (0 if cuda else 1)
    a.model = a.model or (M15 if cuda else "small")
    a.clock = a.clock or ("wall" if cuda else "cpu")
    if a.pin is None:
        a.pin = "" if cuda else str(max(os.sched_getaffinity(0)))
    a.pin = "" if a.pin == "none" else a.pin
    if a.rounds < 3 * a.processes:
        parser().error("--rounds: at least 3 a process pair (an interval needs rounds to resample)")
    return a


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["refresh-baseline"]:
        return refresh_baseline(argv[1:])
    a = parse(argv)
    try:
        record = ab(a)
    except ABError as e:
        print(f"gates.ab: {e}", file=sys.stderr)
        return 2
    print(ab_report.text(record))
    print(f"(written to {a.out}: ab.md, ab.json{', ab.png' if (Path(a.out) / 'ab.png').exists() else ''})")
    return 1 if record["regression"] else 0


if __name__ == "__main__":
    sys.exit(main())
