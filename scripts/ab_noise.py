"""A/A noise and planted-slowdown sensitivity of `python -m gates.ab` on this machine: runs it N times head against
head (A/A: must never alert) and N times with head planted slower by a share of its step (must alert every time),
alternating, each under its own deadline, and prints one line per run as it ends and the table last (verdict,
ratio, interval, each process pair's ratio, seconds). These are the figures the thresholds in gates/ab_stats.py and
docs/ab.md come from. With --base-tree DIR the runs are A/B instead: head against that checkout (kind `ab`, e.g.
the engine before a refactor), N times, to read the difference and its spread from run to run.

    python scripts/ab_noise.py --runs 5 --plant 0.10 --out results/ab-noise -- --workload uniform-cpu --rows 4 \
        --kinds pure-decode                                                  # CPU, the tests' configuration
    python scripts/ab_noise.py --runs 5 --plant 0.05 --out $OUT/ab-noise -- --device cuda --config flash \
        --kinds pure-decode                                                  # the H200 (scripts/h200_ab.sh)
    python scripts/ab_noise.py --runs 3 --base-tree .device/base --kinds ab,aa -- --device cuda   # before/after

Arguments after `--` go to every gates.ab run. Each run's files (ab.md, ab.json, ab.png, the sides' logs) are kept
under --out/NN-aa, NN-planted or NN-ab; noise.json and noise.md hold the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def one(kind: str, i: int, a, extra: list[str]) -> dict:
    out = Path(a.out) / f"{i:02d}-{kind}"
    base = a.base_tree if kind == "ab" else str(REPO)
    cmd = [sys.executable, "-m", "gates.ab", "--base-tree", base, "--out", str(out), "--quiet",
           "--deadline", str(a.deadline), *extra]
    if kind == "planted":
        cmd += ["--plant-head-frac", str(a.plant)]
    t0 = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "run.log", "w") as log:
        try:       # the run's own --deadline ends it first; this is the backstop for a hung worker
            rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=a.deadline + 60,
                                env=dict(os.environ, PYTHONPATH=str(REPO))).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    row = dict(run=f"{i:02d}", kind=kind, rc=rc, seconds=round(time.monotonic() - t0, 1))
    try:
        rec = json.loads((out / "ab.json").read_text())
    except (OSError, json.JSONDecodeError):
        return dict(row, benchmarks=[], error=f"no ab.json (see {out / 'run.log'})")
    row["benchmarks"] = [dict(name=b["name"], verdict=b["verdict"], ratio=b["ratio"], low=b["low"], high=b["high"],
                              pairs=b.get("pair_ratios", []), other=b["other_clock"]) for b in rec["benchmarks"]]
    row["clock"], row["threshold"], row["rounds"] = rec["clock"], rec["threshold"], rec["rounds"]
    return row


def lines(rows: list[dict]) -> list[str]:
    out = ["| run | kind | benchmark | verdict | ratio [95% CI] | each process pair | other clock | seconds | exit |",
           "|" + "---|" * 9]
    for r in rows:
        for b in r["benchmarks"] or [dict(name=r.get("error", "-"), verdict="-", ratio=0, low=0, high=0, pairs=[],
                                          other=dict(clock="-", ratio=0))]:
            pairs = " ".join(f"{x:.3f}" for x in b["pairs"]) or "-"
            out.append(f"| {r['run']} | {r['kind']} | {b['name']} | {b['verdict']} | {b['ratio']:.3f}x "
                       f"[{b['low']:.3f}, {b['high']:.3f}] | {pairs} | {b['other']['clock']} {b['other']['ratio']:.3f}x"
                       f" | {r['seconds']:.0f} | {r['rc']} |")
    return out


def verdicts(rows: list[dict]) -> list[str]:
    """Whether the runs did what they are for: A/A never alerted, planted always did; A/B runs (against another
    tree) have no right answer, only a count."""
    out = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        runs = [r for r in rows if r["kind"] == kind]
        alerted = sum(1 for r in runs if r["rc"] == 1)
        if kind == "ab":
            out.append(f"ab: {alerted} of {len(runs)} runs alerted")
            continue
        ok = alerted == 0 if kind == "aa" else alerted == len(runs)
        want = "no alert" if kind == "aa" else "alert"
        out.append(f"{kind}: {alerted} of {len(runs)} runs alerted (want: {want}) -> {'OK' if ok else 'NOT OK'}")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="scripts/ab_noise.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="runs of each kind (default 5)")
    ap.add_argument("--plant", type=float, default=0.10, help="head's planted share of a step (default 0.10)")
    ap.add_argument("--deadline", type=float, default=120, help="seconds for one gates.ab run (default 120)")
    ap.add_argument("--budget", type=float, default=0,
                    help="seconds for all runs: a run that would not fit its deadline in what is left is not started")
    ap.add_argument("--base-tree", default=None,
                    help="a checkout to compare head against in `ab` runs (e.g. the engine before a refactor)")
    ap.add_argument("--kinds", default=None,
                    help="run kinds, comma separated, alternating within each of the --runs: aa, planted, ab "
                         "(default: aa,planted; with --base-tree: ab)")
    ap.add_argument("--out", default="results/ab-noise")
    a = ap.parse_args(ours)
    kinds = (a.kinds or ("ab" if a.base_tree else "aa,planted")).split(",")
    if set(kinds) - {"aa", "planted", "ab"} or ("ab" in kinds and not a.base_tree):
        ap.error(f"--kinds {a.kinds}: aa, planted or ab (ab needs --base-tree)")
    if a.base_tree:
        a.base_tree = str(Path(a.base_tree).resolve())
    Path(a.out).mkdir(parents=True, exist_ok=True)
    rows = []
    end = time.monotonic() + a.budget if a.budget else None
    for i in range(a.runs):
        for kind in kinds:          # alternating, so a slow spell of the host hits every kind
            if end is not None and end - time.monotonic() < a.deadline:
                print(f"{kind} run {len(rows) + 1}: not run (budget)", flush=True)
                continue
            rows.append(one(kind, len(rows) + 1, a, extra))
            print(lines(rows[-1:])[-1], flush=True)
            (Path(a.out) / "noise.json").write_text(json.dumps(rows, indent=1))
    text = "\n".join(lines(rows) + [""] + verdicts(rows))
    (Path(a.out) / "noise.md").write_text(text + "\n")
    print(text)
    return 1 if any(v.endswith("NOT OK") for v in verdicts(rows)) else 0


if __name__ == "__main__":
    sys.exit(main())
