"""The gate summary, a pytest plugin. A comparison gate records its report here; the record travels to the process
that reports the run inside the test's own report (its user_properties), so a run over xdist workers is summarised
by its controller exactly as a plain run summarises itself: a table in the terminal (requests identical / with
accepted flips / failed, flip sites with gaps), a JSON file rewritten after every gate (a run cut short by a CI
timeout still leaves what it gated), and a Markdown page for a reviewer (the gates, failures with their triage
verdict, the slowest gates), appended to $GITHUB_STEP_SUMMARY when that is set."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from . import coverage
from .compare import GateReport
from .candidates import is_gate_file

KEY = "stepgate-gate"            # the user property a gate record travels in
STACKS_KEY = "stepgate_stacks"   # workerinput: where a worker leaves the stacks of a gate that hung
PENDING: list[dict] = []         # records of the test now running, not yet in its report


def record(report: GateReport) -> GateReport:
    PENDING.append(report.summary())
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    if PENDING or coverage.PENDING:   # a new list: the item's own user_properties are shared by its three reports
        rep.user_properties = [*rep.user_properties, *((KEY, {**g, "test": item.nodeid}) for g in PENDING),
                               *coverage.PENDING]
        PENDING.clear()
        coverage.PENDING.clear()
    return rep


def pytest_configure(config):
    if not hasattr(config, "workerinput"):      # an xdist worker's reports go to its controller, which summarises
        config.pluginmanager.register(GateSummary(config), "stepgate-gate-summary")


@dataclass
class Failure:
    nodeid: str
    when: str                    # setup, call or teardown
    lines: list[str]             # the first lines of the message
    verdict: str | None          # triage's one-line cause (gates/triage.py), where the gate ran one


@dataclass
class Run:
    """What the reports of one run say about its gates."""
    gates: list[dict] = field(default_factory=list)          # GateReport.summary() of every comparison gate
    outcomes: dict[str, int] = field(default_factory=dict)   # gate-file tests: passed / failed / skipped / error
    failures: list[Failure] = field(default_factory=list)
    durations: dict[str, float] = field(default_factory=dict)   # seconds per gate-file test, all phases
    order: dict[str, int] = field(default_factory=dict)         # each test's place in the collection
    began: float = field(default_factory=time.time)             # the run's start (the controller's configure)
    workers: dict[str, "Span"] = field(default_factory=dict)    # xdist worker id -> what it ran, and when
    census: dict = field(default_factory=dict)          # the path census of every engine run (gates/coverage.py)
    served: dict[str, str] = field(default_factory=dict)         # engine run -> its served configuration's key
    checked: dict[str, int] = field(default_factory=dict)       # kernel path -> kernel gate cases that passed
    backends: tuple[str, ...] = ()                                # the run's selected backends

    def in_collection_order(self) -> None:
        """Gates and failures in the order of their tests, whichever worker finished first."""
        def place(nodeid: str) -> int:
            return self.order.get(nodeid, len(self.order))
        self.gates.sort(key=lambda g: place(g.get("test", "")))
        self.failures.sort(key=lambda f: place(f.nodeid))

    def add(self, report) -> bool:
        """Take one test report; True if it brought a gate record."""
        new = [value for name, value in report.user_properties if name == KEY]
        self.gates += new
        for name, value in report.user_properties:
            if name == coverage.SERVED_KEY:
                coverage.merge(self.census, value["rows"])
                self.served[value["label"]] = value["served"]
            elif name == coverage.CHECKED_KEY:
                self.checked[value] = self.checked.get(value, 0) + 1
        if not is_gate_file(report.nodeid):
            return bool(new)
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        worker = getattr(getattr(report, "node", None), "gateway", None)    # xdist: the worker that ran it
        if worker is not None:
            self.workers.setdefault(worker.id, Span()).add(report)
        outcome = None
        if report.failed:
            outcome = "error" if report.when in ("setup", "teardown") else "failed"
            self.failures.append(failure_of(report))
        elif report.skipped and report.when in ("setup", "call"):
            outcome = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        elif report.when == "call":
            outcome = "xpassed" if hasattr(report, "wasxfail") else "passed"
        if outcome:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        return bool(new)

    def timed_out(self, nodeid: str, stacks: str) -> None:
        """`nodeid` hung: its failure (taken from a crashed worker's report, or new) shows where."""
        last = self.failures[-1] if self.failures else None
        if last is None or last.nodeid != nodeid:
            last = Failure(nodeid, "timeout", [], None)
            self.failures.append(last)
            self.outcomes["failed"] = self.outcomes.get("failed", 0) + 1
        last.when, last.lines = "timeout", hang_lines(stacks)

    def coverage_problems(self) -> list[str]:
        """The coverage gate's failures; none where the kernel gate did not run (a run of a few gate files)."""
        if not self.checked:
            return []
        return coverage.problems(self.census, self.checked, coverage.declared_here(self.checked, self.backends))

    def worker_rows(self) -> list[tuple[str, int, float, float, float, float]]:
        """(worker, gates, busy s, first gate's start, last gate's end, idle s) in worker order; idle: the run's
        wall time after the worker's first gate began, less its busy time."""
        end = max(span.last for span in self.workers.values()) - self.began
        rows = []
        for wid in sorted(self.workers, key=lambda w: (len(w), w)):       # gw2 before gw10
            gates, busy, first, last = self.workers[wid].row(self.began)
            rows.append((wid, gates, busy, first, last, max(0.0, end - first - busy)))
        return rows

    def unit_rows(self, shown: int = 6) -> list[tuple[str, str]]:
        """(worker, its work units by busy time, the largest first: `unit s`, the rest summed), in worker order:
        which units made a worker the last to finish."""
        rows = []
        for wid in sorted(self.workers, key=lambda w: (len(w), w)):
            units = sorted(self.workers[wid].units.items(), key=lambda kv: -kv[1])
            cells = [f"{unit} {busy:.1f}" for unit, busy in units[:shown]]
            if len(units) > shown:
                cells.append(f"{len(units) - shown} more {sum(b for _, b in units[shown:]):.1f}")
            rows.append((wid, ", ".join(cells)))
        return rows

    def slowest(self, n: int = 10) -> list[tuple[str, float]]:
        return sorted(self.durations.items(), key=lambda kv: -kv[1])[:n]


@dataclass
class Span:
    """One xdist worker's share of the run: how long it gated, when its first gate began and its last ended (epoch
    seconds, from the reports), so a reviewer sees whether `-n` spread the suite or one worker carried it."""
    gates: int = 0
    busy: float = 0.0
    first: float = float("inf")
    last: float = 0.0
    units: dict[str, float] = field(default_factory=dict)   # busy s by work unit (gates.workers.worker_group)

    def add(self, report) -> None:
        from .placement import worker_group
        self.gates += report.when == "setup"
        self.busy += report.duration
        unit = worker_group(report.nodeid)
        self.units[unit] = self.units.get(unit, 0.0) + report.duration
        if report.start:
            self.first, self.last = min(self.first, report.start), max(self.last, report.stop)

    def row(self, began: float) -> tuple[int, float, float, float]:
        """(gates, busy s, first gate's start, last gate's end), both in seconds after the run began."""
        return self.gates, self.busy, self.first - began, self.last - began


VERDICT = re.compile(r"^(?:E\s+)?\s*verdict: (.*)$", re.M)


def failure_of(report, keep: int = 4) -> Failure:
    """The message's first lines (pytest's `E` lines where it printed a traceback) and triage's verdict."""
    text = report.longreprtext or ""
    lines = text.splitlines()
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ")]
    lines = [ln for ln in (errors or [ln.strip() for ln in lines]) if ln and not VERDICT.match(ln)]
    if lines and lines[0].startswith("AssertionError: "):     # a message given: pytest's own explanation after it
        lines = lines[:next((i for i, ln in enumerate(lines) if ln.startswith("assert ")), len(lines))]
    m = VERDICT.search(text)
    return Failure(report.nodeid, report.when, lines[:keep], m.group(1).strip() if m else None)


def stacks_file(nodeid: str) -> str:
    return hashlib.sha256(nodeid.encode()).hexdigest()[:16] + ".txt"


def hang_lines(stacks: str, keep: int = 14) -> list[str]:
    """The timeout's first line and the end of the main thread's stack: where it hung."""
    head, _, main = stacks.partition("Stack of MainThread")
    return [head.splitlines()[0]] + [ln.rstrip() for ln in main.splitlines()[1:] if ln.strip()][-keep:]


def timed_out(item, stacks: str) -> None:
    """Last words of a process whose gate hung (gates/workers.py ends it next): an xdist worker leaves the stacks
    for its controller; a run without workers writes its summaries with the hung gate as a failure."""
    where = getattr(item.config, "workerinput", {}).get(STACKS_KEY)
    if where:
        (Path(where) / stacks_file(item.nodeid)).write_text(stacks)
    collector = item.config.pluginmanager.get_plugin("stepgate-gate-summary")
    if collector is not None:
        collector.run.timed_out(item.nodeid, stacks)
        collector.finish(item.config)


class GateSummary:
    def __init__(self, config):
        self.json_path = Path(config.getoption("--gate-summary"))
        self.md_path = Path(config.getoption("--gate-summary-md"))
        self.run = Run()
        self.stacks_dir: str | None = None

    def selected_backends(self, config) -> None:
        """The run's selected backends, for the coverage gate (read once the options are)."""
        from .options import gate_options
        self.run.backends = gate_options(config).backends

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node):
        if self.stacks_dir is None:
            self.stacks_dir = tempfile.mkdtemp(prefix="stepgate-stacks-")
        node.workerinput[STACKS_KEY] = self.stacks_dir

    def pytest_collection_finish(self, session):
        self.run.order = {item.nodeid: i for i, item in enumerate(session.items)}

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids):
        self.run.order = self.run.order or {nodeid: i for i, nodeid in enumerate(ids)}

    def pytest_runtest_logreport(self, report):
        if self.run.add(report):
            write_json(self.json_path, self.run.gates)
        if self.stacks_dir and report.failed:       # a worker that hung there was ended: its stacks say where
            stacks = Path(self.stacks_dir, stacks_file(report.nodeid))
            if stacks.is_file():
                self.run.timed_out(report.nodeid, stacks.read_text())

    def pytest_sessionfinish(self, session):
        self.selected_backends(session.config)
        # the coverage gate: a path taken that no kernel check covered, or a declared one nothing ran, fails the run
        if self.run.coverage_problems() and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        self.finish(session.config)
        if self.stacks_dir:
            shutil.rmtree(self.stacks_dir, ignore_errors=True)

    def finish(self, config) -> None:
        if not (self.run.gates or self.run.durations):
            return
        self.run.in_collection_order()
        if self.run.gates:
            write_json(self.json_path, self.run.gates)
        text = markdown(self.run, header(config))
        write_text(self.md_path, text)
        step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
        if step_summary:
            with open(step_summary, "a") as f:
                f.write(text + "\n")

    def pytest_terminal_summary(self, terminalreporter):
        if not (self.run.gates or self.run.durations):
            return
        tr = terminalreporter
        bad = self.run.coverage_problems()
        if bad:
            tr.section("stepgate path coverage gate: FAILED", red=True)
            for line in bad:
                tr.write_line(line, red=True)
            tr.write_line("Check the path in the kernel gate (its cases come from kernels.declared_paths), or stop "
                          "taking or declaring it.", red=True)
        tr.section("stepgate gate summary")
        for line in lines(self.run.gates):
            tr.write_line(line)
        if self.run.workers:
            tr.write_line("workers (gates, busy s, first gate began at s): " + ", ".join(
                f"{wid} {gates}/{busy:.1f}/{first:.1f}" for wid, gates, busy, first, _, _ in self.run.worker_rows()))
        written = [str(self.md_path)] + ([str(self.json_path)] if self.run.gates else [])
        tr.write_line(f"(written to {' and '.join(written)}"
                      + (", appended to $GITHUB_STEP_SUMMARY)" if os.environ.get("GITHUB_STEP_SUMMARY") else ")"))


def flip_sites(gate: dict) -> dict[str, list[dict]]:
    sites: dict[str, list[dict]] = {}
    for f in gate["flips"]:
        sites.setdefault(f["site"], []).append(f)
    return sites


def flip_line(site: list[dict]) -> str:
    f = site[0]
    return (f"flip site {f['request_id']}@{f['position']}: {f['ref_token']}->{f['cand_token']} "
            f"gaps ref {f['ref_gap']:.4f} cand {f['cand_gap']:.4f}"
            + (f" (x{len(site)} requests)" if len(site) > 1 else "")
            + (" [teacher-forced]" if f["teacher_forced"] else ""))


def lines(gates: list[dict]) -> list[str]:
    if not gates:
        return []
    w = max(len(g["gate"]) for g in gates)
    out = [f"{'gate':<{w}}  identical  flipped  failed  sites  sched-diffs  verdict"]
    for g in gates:
        out.append(f"{g['gate']:<{w}}  {g['identical']:>9}  {g['flipped']:>7}  {g['failed']:>6}  "
                   f"{g['flip_sites']:>5}  {g['schedule_differences']:>11}  {'ok' if g['ok'] else 'FAIL'}")
        out += [f"{'':<{w}}    {flip_line(site)}" for site in flip_sites(g).values()]
    return out


def write_text(path, text: str) -> None:
    """Atomically (a reader never sees half a file); a path that is not a plain file (/dev/null, a pipe) is
    written in place, never replaced."""
    path = Path(path)
    if path.exists() and not path.is_file():
        with open(path, "w") as f:
            f.write(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def write_json(path, gates: list[dict]) -> None:
    write_text(path, json.dumps(gates, indent=2) + "\n")


# -- Markdown -------------------------------------------------------------------------------------------------------
def header(config) -> str:
    from .options import gate_options
    from .placement import serial_note, xdist_workers
    o, workers = gate_options(config), xdist_workers(config)
    note = serial_note(config)
    return (f"device {o.device}, dtype {o.dtype}, model {o.model}, engines {','.join(o.engines)}, "
            f"backends {','.join(o.backends)}" + (f"; {workers} xdist workers" if workers else "")
            + (f"\n\n{note}." if note else ""))


def cell(text) -> str:
    return str(text).replace("|", "\\|")


def markdown(run: Run, about: str, slowest: int = 10) -> str:
    """The reviewer's page: the outcome, each comparison gate's counts and flip sites, each failure's first lines
    and triage verdict, and the slowest gates."""
    bad = run.outcomes.get("failed", 0) + run.outcomes.get("error", 0) + sum(not g["ok"] for g in run.gates)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(run.outcomes.items())) or "no gate-file tests"
    out = [f"## stepgate gates: {'FAILED' if bad else 'passed'} ({counts})", "", about, ""]
    if run.gates:
        ok = sum(g["ok"] for g in run.gates)
        out += [f"### Comparison gates ({ok} of {len(run.gates)} ok)", "",
                "| gate | identical | flipped | failed | flip sites | schedule diffs | verdict |",
                "|---|---:|---:|---:|---:|---:|---|"]
        out += [f"| {cell(g['gate'])} | {g['identical']} | {g['flipped']} | {g['failed']} | {g['flip_sites']} | "
                f"{g['schedule_differences']} | {'ok' if g['ok'] else '**FAIL**'} |" for g in run.gates]
        sites = [(g["gate"], site) for g in run.gates for site in flip_sites(g).values()]
        if sites:
            out += ["", "Accepted flips (near ties under the 0.02 rule in both engines' raw logits):", ""]
            out += [f"- {cell(gate)}: {flip_line(site)}" for gate, site in sites]
        out.append("")
    if run.census:
        bad = run.coverage_problems()
        verdict = ("**FAILED**" if bad else "ok") if run.checked else "not judged: the kernel gate did not run"
        out += [f"### Path census (the coverage gate: {verdict})", "",
                "Steps the gates' engines ran, by path; the kernel paths each took were checked by the kernel gate "
                "against fp32 attention on a cache rebuilt from the pages (checks passed per path below).", "",
                "| step kind | kernel paths | mode | buckets (rows or tokens x width) | launched ahead | prefix hit | "
                "steps |", "|---|---|---|---|---|---|---:|"]
        out += [f"| {kind} | {cell(kp)} | {mode} | {cell(b)} | {'yes' if ahead else ''} | {'yes' if hit else ''} | "
                f"{n} |" for kind, kp, mode, b, ahead, hit, n in coverage.census_table(run.census)]
        if run.checked:
            out += ["", "Kernel paths checked: " + ", ".join(f"`{p}` ({n})" for p, n in sorted(run.checked.items()))]
        out += [f"- **{cell(line)}**" for line in bad] if run.checked else []
        if run.served:
            out += ["", "Served configurations (EngineConfig.resolved().key()):", ""]
            out += [f"- {cell(label)}: `{key}`" for label, key in sorted(run.served.items())]
        out.append("")
    if run.failures:
        out += [f"### Failures ({len(run.failures)})", ""]
        for f in run.failures:
            out += [f"#### `{f.nodeid}`" + (f" ({f.when})" if f.when != "call" else ""), "", "```text",
                    *f.lines, "```", ""]
            out += [f"**triage verdict:** {f.verdict}", ""] if f.verdict else []
    if run.workers:
        out += ["### Workers", "", "The first gate's start counts from the run's start (worker start-up, imports, "
                "collection); the idle time is the rest of the run's wall time after its start-up.", "",
                "| worker | gates | busy s | first gate began at s | last gate ended at s | idle s |",
                "|---|---:|---:|---:|---:|---:|"]
        out += [f"| {wid} | {gates} | {busy:.1f} | {first:.1f} | {last:.1f} | {idle:.1f} |"
                for wid, gates, busy, first, last, idle in run.worker_rows()]
        out += ["", "Each worker's work units (an engine configuration's gates, or a file's), busy seconds:", "",
                "| worker | work units |", "|---|---|"]
        out += [f"| {wid} | {cell(units)} |" for wid, units in run.unit_rows()]
        out.append("")
    if run.durations:
        out += [f"### Slowest gates ({min(slowest, len(run.durations))} of {len(run.durations)})", "", "| gate | seconds |", "|---|---:|"]
        out += [f"| `{cell(nodeid)}` | {seconds:.1f} |" for nodeid, seconds in run.slowest(slowest)]
        out.append("")
    return "\n".join(out)
