"""The gate summary, a pytest plugin. A comparison gate records its report here; the record travels to the process
that reports the run inside the test's own report (its user_properties), so a run over xdist workers is summarised
by its controller exactly as a plain run summarises itself: a table in the terminal (requests identical / with
accepted flips / failed, flip sites with gaps), a JSON file rewritten after every gate (a run cut short by a CI
timeout still leaves what it gated), and a Markdown page for a reviewer (the gates, failures with their triage
verdict, the slowest gates), appended to $GITHUB_STEP_SUMMARY when that is set. The table and the page are drawn by
gates/summary_tables.py; this module gathers the reports and writes the files."""
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
from .summary_tables import header, lines, markdown

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

    def by_file(self) -> list[tuple[str, int, float]]:
        """(gate file, gates, seconds in all phases), the most seconds first: where a run's time went."""
        files: dict[str, list] = {}
        for nodeid, seconds in self.durations.items():
            f = files.setdefault(nodeid.split("::")[0], [0, 0.0])
            f[0] += 1
            f[1] += seconds
        return sorted(((name, n, secs) for name, (n, secs) in files.items()), key=lambda r: -r[2])


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
        if self.run.durations:
            tr.write_line("gate time by file (s, all phases): " + ", ".join(
                f"{name.rsplit('/', 1)[-1]} {secs:.1f}" for name, _, secs in self.run.by_file()))
        if self.run.workers:
            tr.write_line("workers (gates, busy s, first gate began at s): " + ", ".join(
                f"{wid} {gates}/{busy:.1f}/{first:.1f}" for wid, gates, busy, first, _, _ in self.run.worker_rows()))
        written = [str(self.md_path)] + ([str(self.json_path)] if self.run.gates else [])
        tr.write_line(f"(written to {' and '.join(written)}"
                      + (", appended to $GITHUB_STEP_SUMMARY)" if os.environ.get("GITHUB_STEP_SUMMARY") else ")"))


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
