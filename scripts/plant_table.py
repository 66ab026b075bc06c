"""The planted-bug table: for each plant of tests/plants.py, one CPU gate run with that bug planted for the session,
stopped at the first failure (`-x`); records the first failing gate, the seconds from launch to it (wall clock, and
the pytest process's CPU seconds, which a loaded machine does not inflate), and whether the message names the cause.

    python scripts/plant_table.py --out docs/plants.md                 # every plant
    python scripts/plant_table.py --plants rotary,fcfs --timeout 600   # some

A plant that no gate catches is reported as "not caught"; a run that ends with no failing test but a nonzero exit
(a usage error, a session-level check) is reported as caught by the session. The gates run in the suite's own order
(gates/conftest.py: the smoke gate first)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.plants import PLANTS, Plant  # noqa: E402

MARKERS = "not slow and not gpu"
FAST_SECONDS = 20.0          # a number-changing plant must fail the CPU run within this
EXCERPT = 420                # characters of the failure message quoted in the table
ISOLATED = "gates/test_admission.py"   # the hypothesis gate: the scheduling plants are also run without it


@dataclass(frozen=True)
class Row:
    plant: str
    label: str
    deselect: tuple[str, ...] = ()


def rows(names: list[str]) -> list[Row]:
    out = []
    for n in names:
        out.append(Row(n, n))
        if n in ("fcfs", "eager-free"):
            out.append(Row(n, f"{n}, {Path(ISOLATED).name} deselected", (ISOLATED,)))
    return out


def pytest_cmd(args) -> list[str]:
    return [sys.executable, "-m", "pytest", *args, "-m", MARKERS, "-q", "-p", "no:cacheprovider"]


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


@dataclass
class Result:
    row: Row
    caught: bool
    gate: str
    seconds: float
    cpu: float | None
    named: bool | None
    excerpt: str
    exit: int | str


def excerpt_of(text: str, cause: str) -> str:
    """Where the cause is named: the line its pattern's match starts in and, if another, the line it ends in; else the
    first assertion line, else the last line."""
    def clean(line: str) -> str:
        line = line.strip().strip("=").strip()      # a pytest section header's rules, too
        return line[2:].strip() if line.startswith("E ") else line

    def line_at(i: int) -> str:
        end = text.find("\n", i)
        return clean(text[text.rfind("\n", 0, i) + 1:end if end >= 0 else None])

    found = re.search(cause, text)
    if found:
        first, last = line_at(found.start()), line_at(max(found.start(), found.end() - 1))
        return first if first == last else f"{first[:2 * EXCERPT // 3]} … {last}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln.startswith(("E ", "ERROR", "AssertionError"))] or lines[-1:] or [""]
    return clean(lines[0])


def run_row(row: Row, timeout: float, log_dir: Path) -> Result:
    plant: Plant = PLANTS[row.plant]
    tmp = Path(tempfile.mkdtemp(prefix=f"plant-{row.plant}-"))
    fill = lambda args: [a.replace("{tmp}", str(tmp)) for a in args]  # noqa: E731
    env = dict(os.environ, PYTHONPATH=str(REPO), HYPOTHESIS_PROFILE="ci")     # as .ci/run runs the gates
    env.pop("STEPGATE_PLANT_SLOWDOWN_MS", None)
    summary = f"--gate-summary={tmp / 'gate-summary.json'}"
    if plant.baseline:
        subprocess.run(pytest_cmd([*fill(plant.baseline), summary]), cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout)
    record = tmp / "first-failure.json"
    cmd = pytest_cmd([*(plant.paths or ("gates/",)), "-x", "-p", "tests.plants", "--plant", row.plant,
                      "--plant-record", str(record), summary, *fill(plant.args)])
    cmd += [f"--deselect={d}" for d in row.deselect]
    cpu0, t0 = child_cpu(), time.time()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        text = lambda b: b if isinstance(b, str) else (b or b"").decode(errors="replace")  # noqa: E731
        rc, out = "timeout", text(e.stdout) + text(e.stderr)
    elapsed = time.time() - t0
    (log_dir / f"{row.label.replace(' ', '_').replace(',', '')}.log").write_text(" ".join(cmd) + "\n\n" + out)
    rec = json.loads(record.read_text()) if record.exists() else None
    return classify(row, rec, rc, out, t0, elapsed, child_cpu() - cpu0 if rc != "timeout" else None)


def classify(row: Row, rec: dict | None, rc, out: str, t0: float, elapsed: float, cpu: float | None) -> Result:
    """A run's row: caught by its first failing report, else by the session (a nonzero exit), else not caught."""
    cause = PLANTS[row.plant].cause
    if rec is not None:
        text = rec["message"] + "\n" + out
        return Result(row, True, rec["nodeid"], rec["time"] - t0, rec["cpu_s"], bool(re.search(cause, text)),
                      excerpt_of(text, cause), rc)
    if rc not in (0, "timeout"):
        return Result(row, True, f"(session, exit {rc})", elapsed, cpu, bool(re.search(cause, out)),
                      excerpt_of(out, cause), rc)
    return Result(row, False, "not caught" if rc == 0 else "not caught (timed out)", elapsed, cpu, None, "", rc)


def markdown(results: list[Result], header: str) -> str:
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = [header, "",
             "| planted bug | what | changes numbers | first failing gate | s to first failure | CPU s "
             "| names the cause | message |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        plant = PLANTS[r.row.plant]
        cpu = "" if r.cpu is None else f"{r.cpu:.1f}"
        slow = plant.number_changing and r.caught and (r.cpu if r.cpu is not None else r.seconds) > FAST_SECONDS
        secs = f"{r.seconds:.1f}"
        cpu += f" (over {FAST_SECONDS:.0f} s)" if slow else ""
        named = "—" if r.named is None else ("yes" if r.named else "no")
        lines.append(f"| `{r.row.label}` | {esc(plant.what)} | {'yes' if plant.number_changing else ''} | "
                     f"`{esc(r.gate)}` | {secs if r.caught else '—'} | {cpu if r.caught else '—'} | {named} | "
                     f"{esc(r.excerpt[:EXCERPT])} |")
    planted = sorted({r.row.plant for r in results}, key=list(PLANTS).index)
    return "\n".join(lines) + "\n" + shared_causes(planted)


def shared_causes(names: list[str]) -> str:
    """A note naming the plants whose messages are told apart by one pattern only (so not from each other)."""
    by_cause: dict[str, list[str]] = {}
    for n in names:
        by_cause.setdefault(PLANTS[n].cause, []).append(n)
    groups = [g for g in by_cause.values() if len(g) > 1]
    if not groups:
        return ""
    return "".join(f"\n{', '.join(f'`{n}`' for n in g)}: one cause pattern, so their messages name the same cause; "
                   f"the table does not claim they are told apart from each other.\n" for g in groups)


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/plant_table.py", description=__doc__.splitlines()[0])
    ap.add_argument("--plants", default=",".join(PLANTS), help=f"comma-separated, from: {', '.join(PLANTS)}")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per gate run")
    ap.add_argument("--out", default=None, help="also write the Markdown table here")
    ap.add_argument("--logs", default=None, help="where each run's full output goes (default: a temporary folder)")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.plants.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANTS]
    if unknown:
        ap.error(f"unknown plant(s) {unknown}; known: {', '.join(PLANTS)}")
    import torch
    gpu_only = [n for n in names if PLANTS[n].device == "cuda" and not torch.cuda.is_available()]
    if gpu_only:
        print(f"[plant] not run here (they plant a GPU path; no CUDA device): {', '.join(gpu_only)}", flush=True)
        names = [n for n in names if n not in gpu_only]
    log_dir = Path(a.logs or tempfile.mkdtemp(prefix="plant-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results, load0 = [], os.getloadavg()[0]
    for row in rows(names):
        print(f"[plant] {row.label} ...", flush=True)
        r = run_row(row, a.timeout, log_dir)
        print(f"[plant] {row.label}: {r.gate} after {r.seconds:.1f} s (exit {r.exit})", flush=True)
        results.append(r)
    commit = git("rev-parse", "--short", "HEAD") + \
        (" with uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    header = (f"Planted bugs on CPU ({platform.node()}, {os.cpu_count()} cores, load average {load0:.1f} at the "
              f"start, {os.getloadavg()[0]:.1f} at the end; commit {commit}, {datetime.date.today().isoformat()}). "
              f"Each row: `HYPOTHESIS_PROFILE=ci python -m pytest gates/ -m \"{MARKERS}\" -x -p tests.plants "
              f"--plant NAME` (and the arguments its description names). Seconds are wall clock from launch to the "
              f"first failing report; CPU s is the pytest process's CPU time then (imports included), which a busy "
              f"machine inflates far less: a number-changing plant is flagged when that is over "
              f"{FAST_SECONDS:.0f} s.")
    table = markdown(results, header)
    print(table)
    print(f"(full output of each run: {log_dir})")
    if a.out:
        Path(a.out).write_text("# Planted bugs: where the gates catch them\n\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
