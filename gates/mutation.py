"""The mutation campaign: cosmic-ray mutates one module at a time in a copy of the tree and runs the module's suite
of gates (gates/mutation.toml) once per mutant; this module drives it and writes the report (per module: killed,
survived, timed out, equivalent, time; every survivor with its diff), Markdown for a CI summary and JSON for history.

    python -m gates.mutation run --module engine/pool.py [--module ...] [--max-minutes 60]
    python -m gates.mutation run --module engine/runner.py --also    # its survivors against its second suite
    python -m gates.mutation report [--markdown mutation.md] [--out mutation.json]

Mutants in the committed allow-list (gates/mutation_equivalent.toml: the original line, the mutated line, why they
are equivalent) are marked skipped in cosmic-ray's session before it runs, and reported as equivalent. docs/mutation.md
has the recipe and the reasons for the choices here."""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import re
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "gates" / "mutation.toml"
WORK = REPO / "results" / "mutation"

# "selective" mutation (Offutt et al., 1996; Kaminski et al., 2011 for comparisons): each arithmetic operator is
# replaced by one other, each comparison by its boundary and its negation, instead of by every operator Python has.
# The rest of cosmic-ray's core operators (numbers, booleans, not, and/or, loops, decorators, break/continue) all run.
SELECTIVE = {
    "ReplaceBinaryOperator": {"Add": {"Sub"}, "Sub": {"Add"}, "Mul": {"FloorDiv"}, "Div": {"Mul"},
                              "FloorDiv": {"Mul"}, "Mod": {"FloorDiv"}, "Pow": {"Mul"}, "LShift": {"RShift"},
                              "RShift": {"LShift"}, "BitOr": {"BitAnd"}, "BitAnd": {"BitOr"}, "BitXor": {"BitOr"},
                              "MatMult": {"Mul"}},
    "ReplaceComparisonOperator": {"Lt": {"LtE", "GtE"}, "LtE": {"Lt", "Gt"}, "Gt": {"GtE", "LtE"},
                                  "GtE": {"Gt", "Lt"}, "Eq": {"NotEq"}, "NotEq": {"Eq"}, "Is": {"IsNot"},
                                  "IsNot": {"Is"}, "In": {"NotIn"}, "NotIn": {"In"}},
}
LEFT_OUT = "not in the selective operator set"
UNREACHED = "not reached: the suite's unmutated run never ran this statement (line"
DEFERRED = "deferred: not run while survivors were run again"
NOT_SURVIVOR = "not a survivor of the module's own suite"


def selected(operator: str) -> bool:
    m = re.fullmatch(r"core/(ReplaceBinaryOperator|ReplaceComparisonOperator)_(\w+?)_(\w+)", operator)
    return m is None or m[3] in SELECTIVE[m[1]].get(m[2], set())


def load_config(path: Path = CONFIG) -> dict:
    return tomllib.loads(path.read_text())


def load_equivalent(path: Path) -> list[dict]:
    """The allow-list: each entry names module, where (the enclosing class and function, dotted), operator, line (the
    original, stripped), mutant (the mutated line, stripped) and why."""
    entries = tomllib.loads(path.read_text()).get("equivalent", []) if path.is_file() else []
    for e in entries:
        missing = {"module", "where", "operator", "line", "mutant", "why"} - set(e)
        if missing:
            raise ValueError(f"{path}: an entry without {sorted(missing)}: {e}")
    return entries


def equivalent_reason(entries: list[dict], module: str, where: str, operator: str, line: str,
                      mutant: str) -> str | None:
    key = (module, where, operator, line.strip(), mutant.strip())
    for e in entries:
        if (e["module"], e["where"], e["operator"], e["line"], e["mutant"]) == key:
            return e["why"]
    return None


def enclosing(source: str, line: int) -> str:
    """The classes and functions around `line`, dotted ("Request.queue_wait"; "" at module level): the same line
    text can sit in two places."""
    lines = source.splitlines()
    if lines[line - 1].strip().startswith("@"):      # a decorator: the place of the function it decorates
        at = next(i for i in range(line, len(lines)) if re.match(r"\s*(async\s+def|def|class)\s", lines[i]))
        name = re.match(r"\s*(?:async\s+def|def|class)\s+(\w+)", lines[at])[1]
        return ".".join(filter(None, [enclosing(source, at + 1), name]))
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
    names = []
    for text in reversed(lines[:line - 1]):
        m = re.match(r"(\s*)(?:async\s+def|def|class)\s+(\w+)", text)
        if m and len(m[1]) < indent:
            names.append(m[2])
            indent = len(m[1])
    return ".".join(reversed(names))


def mutant_lines(source: str, operator: str, occurrence: int, line: int) -> tuple[str, str]:
    """(original line, mutated line), stripped, of one mutation: how the allow-list names it."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator
    mutated = mutate_code(source, get_operator(operator)(), occurrence)
    before, after = source.splitlines(), (mutated or source).splitlines()
    if len(after) < len(before):            # a line removed (a decorator)
        return before[line - 1].strip(), "(removed)"
    return before[line - 1].strip(), after[line - 1].strip()


# -- the campaign ---------------------------------------------------------------------------------------------------
def copy_tree(dest: Path) -> None:
    """The checkout's files (tracked and untracked, not ignored) copied to `dest`: cosmic-ray edits files in place."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    if dest.exists():
        shutil.rmtree(dest)
    for f in filter(None, files):
        src = REPO / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


# cosmic-ray's http distributor posts each mutant to a worker under aiohttp's default client timeout (300 s in all):
# a suite that ran longer (a loaded machine, many workers on one GPU) would come back as an aiohttp error, not a
# verdict. So cosmic-ray runs with that default lifted; the per-mutant timeout stays the suite's own (the worker
# enforces it).
CLI = ("import sys, aiohttp.client as c; c.DEFAULT_TIMEOUT = c.ClientTimeout(total=None, sock_connect=30); "
       "from cosmic_ray.cli import main; sys.exit(main(sys.argv[1:]))")


def cr(*args, cwd: Path, env: dict, timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLI, *args], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True)


def session_config(module: str, timeout: float, command: str, worker_urls: list[str]) -> str:
    """cosmic-ray's config for one module: the local distributor (one mutant at a time, in the copy itself), or the
    http distributor over `worker_urls`."""
    text = (f'[cosmic-ray]\nmodule-path = "{module}"\ntimeout = {timeout}\nexcluded-modules = []\n'
            f"test-command = {json.dumps(command)}\n\n[cosmic-ray.distributor]\n")
    if not worker_urls:
        return text + 'name = "local"\n'
    return text + f'name = "http"\n\n[cosmic-ray.distributor.http]\nworker-urls = {json.dumps(worker_urls)}\n'


def filter_session(db_path: Path, tree: Path, module: str, entries: list[dict], all_operators: bool) -> None:
    """Mark skipped what is not run: operators outside the selective set, and the allow-list's equivalent mutants."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
    source = (tree / module).read_text()
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            m = item.mutations[0]
            if not (all_operators or selected(m.operator_name)):
                db.set_result(item.job_id, WorkResult(output=LEFT_OUT, worker_outcome=WorkerOutcome.SKIPPED))
                continue
            line, mutant = mutant_lines(source, m.operator_name, m.occurrence, m.start_pos[0])
            why = equivalent_reason(entries, module, enclosing(source, m.start_pos[0]), m.operator_name, line, mutant)
            if why:
                db.set_result(item.job_id, WorkResult(output=f"equivalent: {why}", diff=f"- {line}\n+ {mutant}",
                                                      worker_outcome=WorkerOutcome.SKIPPED))


def units(source: str) -> list[tuple[int, int, str]]:
    """The module's units, as mutmut keys its results: each top-level statement, a class's statements taken one by
    one (its methods). (first line with decorators, last line, name and a hash of the text): a unit whose text is
    unchanged since a session holds the same mutants, so their verdicts carry over an edit elsewhere in the module."""
    lines, out = source.splitlines(), []

    def unit(first: int, last: int, name: str) -> None:
        text = "\n".join(lines[first - 1:last])
        out.append((first, last, f"{name}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"))

    for node in ast.parse(source).body:
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        if not isinstance(node, ast.ClassDef):
            unit(first, node.end_lineno, getattr(node, "name", ""))
            continue
        unit(first, node.lineno, node.name)         # the class line and its decorators: a unit of their own
        for n in node.body:
            at = min([n.lineno] + [d.lineno for d in getattr(n, "decorator_list", [])])
            unit(at, n.end_lineno, f"{node.name}.{getattr(n, 'name', '')}")
    return out


def unit_key(found: list[tuple[int, int, str]], operator: str, pos: tuple[int, int]) -> tuple | None:
    """A mutant's place independent of the lines around its unit: (operator, unit, line within it, column)."""
    for first, last, key in found:
        if first <= pos[0] <= last:
            return operator, key, pos[0] - first, pos[1]
    return None


def carry_over(old_db: Path, old_source: str, db_path: Path, source: str) -> int:
    """Verdicts of an earlier session of the module (before an edit) copied to the new session's mutants that sit in
    units whose text is unchanged (mutmut's rule: a changed function runs its mutants again). Returns how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    old_units, new_units, before = units(old_source), units(source), {}
    with use_db(str(old_db), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            m = item.mutations[0]
            # skipped ones are marked again by filter_session; unreached ones again by mark_unreached if still so
            if result.worker_outcome.value != "skipped" and not (result.output or "").startswith(UNREACHED):
                before[unit_key(old_units, m.operator_name, m.start_pos)] = result
    before.pop(None, None)
    carried = 0
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            m = item.mutations[0]
            result = before.get(unit_key(new_units, m.operator_name, m.start_pos))
            if result is not None:
                db.set_result(item.job_id, result)
                carried += 1
    return carried


def session_source(work: Path, module: str, sha: str) -> str | None:
    """The module's text when its session was made: kept beside the session, or (sessions from before it was kept)
    the version in git history with the session's hash."""
    kept = work / f"{slug(module)}.source.py"
    if kept.is_file():
        return kept.read_text()
    revs = subprocess.run(["git", "rev-list", "HEAD", "--", module], cwd=REPO, capture_output=True, text=True).stdout
    for rev in revs.split():
        text = subprocess.run(["git", "show", f"{rev}:{module}"], cwd=REPO, capture_output=True).stdout
        if hashlib.sha256(text).hexdigest()[:16] == sha:
            return text.decode()
    return None


def retest_survivors(db_path: Path) -> None:
    """After a gap is closed: the survivors back to pending (and the runs that failed for want of device memory:
    no verdict), and the mutants never run set aside (DEFERRED) so that cosmic-ray exec runs those alone;
    `restore_deferred` makes the rest pending again."""
    import sqlite3
    with sqlite3.connect(db_path) as c:
        never_run = "SELECT job_id FROM work_items WHERE job_id NOT IN (SELECT job_id FROM work_results)"
        c.execute("INSERT INTO work_results (job_id, worker_outcome, output) SELECT job_id, 'SKIPPED', ? FROM "
                  f"({never_run})", (DEFERRED,))
        c.execute("DELETE FROM work_results WHERE worker_outcome = 'NORMAL' AND test_outcome = 'SURVIVED'")
        lost = [job for job, out in c.execute("SELECT job_id, output FROM work_results WHERE worker_outcome = "
                                              "'NORMAL' AND test_outcome = 'KILLED'") if environmental(out)]
        c.executemany("DELETE FROM work_results WHERE job_id = ?", [(j,) for j in lost])


def restore_deferred(db_path: Path) -> None:
    import sqlite3
    with sqlite3.connect(db_path) as c:
        c.execute("DELETE FROM work_results WHERE output = ?", (DEFERRED,))


def pending(db_path: Path) -> int:
    import sqlite3
    with sqlite3.connect(db_path) as c:
        return c.execute("SELECT COUNT(*) FROM work_items WHERE job_id NOT IN (SELECT job_id FROM work_results)"
                         ).fetchone()[0]


def statement_line(source: str, line: int) -> int:
    """The first line of the innermost statement holding `line` (coverage counts statements by their first line; a
    mutant may sit on a continuation line)."""
    best = None
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best.lineno if best else line


def under_coverage(command: list[str], data: Path, tree: Path, modules: list[str]) -> list[str]:
    """`python -m pytest ...` run under coverage.py, measuring the suite's modules (their paths in `tree`)."""
    if command[1:3] != ["-m", "pytest"]:
        raise ValueError(f"a suite with reach = true runs `python -m pytest ...`, got {command[:3]}")
    include = ",".join(str(tree / m) for m in modules)
    return [command[0], "-m", "coverage", "run", f"--data-file={data}", f"--include={include}", *command[1:]]


def unrun_statements(data: Path, tree: Path, modules: list[str]) -> dict[str, set[int]]:
    """Per module: the statements (their first lines) the measured run never ran."""
    import coverage
    cov = coverage.Coverage(data_file=str(data))
    cov.load()
    out = {}
    for m in modules:
        _, statements, _, missing, _ = cov.analysis2(str(tree / m))
        if not set(statements) - set(missing):
            raise RuntimeError(f"coverage saw no line of {m} run: is the suite the module's?")
        out[m] = set(missing)
    return out


def mark_unreached(db_path: Path, tree: Path, module: str, missing: set[int]) -> int:
    """Mutants on statements the unmutated suite never ran (`missing`): the mutated code cannot run either, so the
    mutant survives; it is recorded as a survivor (to be triaged like any other) without spending a suite run on it.
    Only for suites whose modules Python itself runs (reach = true): a Triton kernel's body or a torch.compile'd
    function runs without Python's line events, so coverage would call it unreached. Returns how many were marked."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult
    source, marked = (tree / module).read_text(), 0
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in list(db.pending_work_items):
            m = item.mutations[0]
            first = statement_line(source, m.start_pos[0])
            if first in missing:
                line, mutant = mutant_lines(source, m.operator_name, m.occurrence, m.start_pos[0])
                db.set_result(item.job_id, WorkResult(output=f"{UNREACHED} {first})", diff=f"- {line}\n+ {mutant}",
                                                      worker_outcome=WorkerOutcome.NORMAL,
                                                      test_outcome=TestOutcome.SURVIVED))
                marked += 1
    return marked


BASELINES: dict[str, float] = {}     # suite command -> seconds of its unmutated run (passed) in this process
REACHED: dict[str, dict[str, set[int]]] = {}   # reach suite command -> module -> statements its run never ran


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(tree: Path, count: int, env: dict, work: Path,
                  threads: int | None = None) -> list[tuple[subprocess.Popen, str]]:
    """`count` cosmic-ray http workers, each in its own copy of `tree` (a worker mutates the files of its working
    directory), each with its share of the cores (torch's threads would otherwise oversubscribe them; `threads`: a
    set share, where other campaigns run beside this one). Returns the processes and their URLs once each answers."""
    threads = str(threads or max(1, (os.cpu_count() or 1) // count))
    workers = []
    for i in range(count):
        copy = tree.with_name(f"{tree.name}.{i}")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(tree, copy)
        port = free_port()
        log = open(work / f"{tree.stem}.worker{i}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "cosmic_ray.cli", "http-worker", "--port", str(port)],
                                cwd=copy, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**env, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": threads})
        workers.append((proc, f"http://127.0.0.1:{port}"))
    for proc, url in workers:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"a cosmic-ray worker exited at start (log under {work})")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"a cosmic-ray worker did not answer on {url}")
    return workers


def stop_workers(workers: list[tuple[subprocess.Popen, str]], tree: Path) -> None:
    """Each worker and the suite it may still be running (its own process group), then its copy of the tree."""
    for proc, _ in workers:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for i in range(len(workers)):
        shutil.rmtree(tree.with_name(f"{tree.name}.{i}"), ignore_errors=True)


def worker_cap(suite: dict, workers: int, device_gib: float | None) -> int:
    """At most as many workers as the device's memory holds runs of the suite at once (its `worker_gib`: what one
    run holds at most); a worker short of memory fails its suite for the device's sake, not the mutant's."""
    gib = suite.get("worker_gib")
    if not gib or not device_gib:
        return workers
    return max(1, min(workers, int(device_gib // gib)))


def device_gib(suite: dict) -> float | None:
    if suite["device"] != "cuda":
        return None
    import torch
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None


def run_module(module: str, cfg: dict, work: Path, deadline: float, resume: bool = False,
               retest: bool = False, workers: int = 1, threads: int | None = None, also: bool = False) -> dict:
    """One module's campaign: copy, cosmic-ray init, filter, a baseline run of the suite, cosmic-ray exec until done
    or the deadline (`resume`: an earlier session's pending mutants, its time added). `workers` > 1: that many
    mutants at a time, through cosmic-ray's http distributor (each worker in its own copy of the tree; on one GPU
    they share it). Returns the run's metadata (also written beside the session).
    `also`: the survivors of the module's session (its own suite's) against its second suite (gates/mutation.toml
    [also]: the CPU gate run, for a CUDA suite's module), in a session of their own beside it; the report counts
    a mutant that suite kills as killed, and says by which suite."""
    suite_name = cfg["also"][module] if also else cfg["modules"][module]
    suite = cfg["suites"][suite_name]
    stem = slug(module) + (".also" if also else "")
    if also:
        main_db = work / f"{slug(module)}.sqlite"
        main_meta = json.loads((work / f"{slug(module)}.meta.json").read_text()) if main_db.is_file() else None
        if main_meta is None or main_meta.get("module_sha") != module_sha(module):
            raise RuntimeError(f"{module}: --also runs the survivors of its own suite's session on this text of the "
                               f"module: none under {work}" if main_meta is None else
                               f"{module} changed since its session was made: run its own suite first (--resume)")
        survivors = {(m["operator"], m["occurrence"]) for m in
                     read_session(main_db, module, load_equivalent(REPO / cfg["equivalent"]))
                     if m["outcome"] == "survived"}
        resume = retest = False         # a fresh session each time: the survivors as they are now
    timeout = float(suite["timeout"])
    if workers > 1 and worker_cap(suite, workers, device_gib(suite)) < workers:
        print(f"{module}: {worker_cap(suite, workers, device_gib(suite))} workers, not {workers}: the device holds no "
              f"more runs of {suite['worker_gib']} GiB", file=sys.stderr)
        workers = worker_cap(suite, workers, device_gib(suite))
    meta_path = work / f"{stem}.meta.json"
    tree, db, cfg_path = work / f"{stem}.tree", work / f"{stem}.sqlite", work / f"{stem}.toml"
    sha = module_sha(module)
    old_meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    before_edit = None          # (the session before the edit, the module's text then)
    if resume and edited_since(meta_path, sha):
        old_source = session_source(work, module, old_meta["module_sha"]) if db.is_file() else None
        if old_source is None:
            print(f"{module} changed since its session was made: a fresh session", file=sys.stderr)
            resume = retest = False
        else:
            before_edit = (db.replace(db.with_name(f"{db.stem}.before-edit.sqlite")), old_source)
    if resume and not retest and meta_path.is_file() and db.is_file() and pending(db) == 0:
        return old_meta      # nothing left to run
    copy_tree(tree)
    command = suite["command"].replace("python ", f"{sys.executable} ", 1)
    env = {**os.environ, "PYTHONPATH": str(tree), "HYPOTHESIS_PROFILE": "ci", "CI": "1"}
    earlier = old_meta.get("seconds", 0) if resume and (db.is_file() or before_edit) else 0
    started, at_commit = time.time(), commit()        # the tree the mutants run on is the one copied now
    entries = load_equivalent(REPO / cfg["equivalent"])
    cfg_path.write_text(session_config(module, timeout, command, []))
    carried = old_meta.get("carried", 0) if resume and not before_edit else 0
    if not (resume and db.is_file()):
        db.unlink(missing_ok=True)
        r = cr("init", str(cfg_path), str(db), cwd=tree, env=env)
        if r.returncode:
            raise RuntimeError(f"cosmic-ray init failed for {module}:\n{r.stderr}")
        filter_session(db, tree, module, entries, cfg.get("operators") == "all")
        if also:
            keep_only(db, survivors)
        (work / f"{slug(module)}.source.py").write_text((tree / module).read_text())
        if before_edit:
            carried = carry_over(before_edit[0], before_edit[1], db, (tree / module).read_text())
            before_edit[0].unlink()
            print(f"{module}: {carried} verdicts carried over from the session before the edit", file=sys.stderr)
    if resume and retest and db.is_file():
        retest_survivors(db)
        filter_session(db, tree, module, entries, all_operators=True)    # survivors since allow-listed: not rerun
    reach = bool(suite.get("reach")) and not also
    if command not in BASELINES:        # modules of one suite share its unmutated run within a campaign; a reach
        # suite's run measures them all at once (the run's tree goes with its module: what it reached is kept here)
        t0 = time.time()
        argv, data = shlex.split(command), work / f"{cfg['modules'][module]}.coverage"
        suite_modules = [m for m, name in cfg["modules"].items() if name == suite_name]
        # sys.monitoring (3.12+): line events at a fraction of the tracer's cost
        cov_env = {**env, "COVERAGE_CORE": "sysmon"} if reach and sys.version_info >= (3, 12) else env
        base = subprocess.run(under_coverage(argv, data, tree, suite_modules) if reach else argv, cwd=tree,
                              env=cov_env, capture_output=True, text=True, timeout=timeout)
        if base.returncode:
            raise RuntimeError(f"the suite fails unmutated ({module}): {command}\n{base.stdout[-3000:]}")
        BASELINES[command] = time.time() - t0
        if reach:
            REACHED[command] = unrun_statements(data, tree, suite_modules)
    if reach:
        n = mark_unreached(db, tree, module, REACHED[command][module])
        print(f"{module}: {n} mutants on statements the suite never runs (survivors, not run)", file=sys.stderr)
    baseline_s = BASELINES[command]
    # never less than three unmutated runs: a machine loaded by other campaigns must not turn slow runs into
    # timeouts (a timeout counts as caught)
    timeout = max(timeout, 3 * baseline_s)
    pool = start_workers(tree, workers, env, work, threads) if workers > 1 else []
    try:
        cfg_path.write_text(session_config(module, timeout, command, [url for _, url in pool]))
        cr("exec", str(cfg_path), str(db), cwd=tree, env=env, timeout=max(1.0, deadline - time.time()))
        if resume and retest:       # the survivors judged again first; then, in the time left, the never-run ones
            restore_deferred(db)
            cr("exec", str(cfg_path), str(db), cwd=tree, env=env, timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        pass                    # the mutants not run stay pending and are reported as not run
    finally:
        stop_workers(pool, tree)
    restore_deferred(db)
    finished = pending(db) == 0
    meta = dict(module=module, suite=suite_name, command=suite["command"], timeout_s=timeout,
                workers=workers,
                device=suite["device"], baseline_s=round(baseline_s, 1),
                seconds=round(earlier + time.time() - started, 1),
                finished=finished, commit=at_commit, module_sha=sha, carried=carried, machine=machine(),
                date=time.strftime("%Y-%m-%d"))
    meta_path.write_text(json.dumps(meta, indent=1))
    shutil.rmtree(tree, ignore_errors=True)
    return meta


def keep_only(db_path: Path, keys: set[tuple[str, int]]) -> None:
    """Mark skipped every pending mutant but those of `keys` ((operator, occurrence): cosmic-ray's names for one
    module's mutants, the same in every session made on the same text)."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item in db.pending_work_items:
            m = item.mutations[0]
            if (m.operator_name, m.occurrence) not in keys:
                db.set_result(item.job_id, WorkResult(output=NOT_SURVIVOR, worker_outcome=WorkerOutcome.SKIPPED))


def killed_elsewhere(work: Path, module: str, mutants: list[dict]) -> list[dict]:
    """The module's mutants with its own suite's survivors that its second suite's session (--also) killed marked
    killed, and a note naming that suite and the test that failed."""
    db, meta_path = work / f"{slug(module)}.also.sqlite", work / f"{slug(module)}.also.meta.json"
    if not db.is_file():
        return mutants
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    killed = {(m["operator"], m["occurrence"]): m for m in read_session(db, module, [])
              if m["outcome"] in ("killed", "timeout")}
    out = []
    for m in mutants:
        k = killed.get((m["operator"], m["occurrence"]))
        if m["outcome"] == "survived" and k:
            m = dict(m, outcome="killed", elsewhere=meta.get("suite", "also"),
                     note=f"killed by the {meta.get('suite', 'second')} suite ({meta.get('device', '?')}, "
                          f"{meta.get('machine', '?')}, {meta.get('commit', '?')}): {k.get('test') or k['outcome']}")
        out.append(m)
    return out


def edited_since(meta_path: Path, sha: str) -> bool:
    """Whether the module changed since the session beside `meta_path` was made: cosmic-ray names a session's
    mutants by operator and occurrence, so on an edited module they would land on other lines (a session made before
    the hash was kept is taken as current)."""
    return meta_path.is_file() and json.loads(meta_path.read_text()).get("module_sha", sha) != sha


def module_sha(module: str) -> str:
    return hashlib.sha256((REPO / module).read_bytes()).hexdigest()[:16]


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    return r.stdout.strip() + ("+dirty" if dirty else "")


def machine() -> str:
    return f"{platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}"


# -- the report -----------------------------------------------------------------------------------------------------
# A suite that failed for want of device memory says nothing of the mutant: a dozen workers on one GPU, each holding
# its gates' engines, can fill it (session 18 found 37 of the runner suite's 188 "kills" were that). The first failure
# is what counts: pytest's FAILED line, or the output's error where there is none (an error at collection).
ENVIRONMENT = re.compile(r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|"
                         r"PoolTooLargeError: .* free on cuda")


def environmental(output: str | None) -> str | None:
    """The environmental cause of a failed suite run (out of device memory), or None: a verdict."""
    failed = re.findall(r"^FAILED .*$|^ERROR .*$", output or "", re.M)
    m = ENVIRONMENT.search(failed[0] if failed else (output or ""))
    return m[0] if m else None


def outcome(worker: str, test: str | None, output: str | None) -> str:
    """One mutant's verdict from cosmic-ray's result: killed, survived, timeout, equivalent, incompetent, left out."""
    if worker == "skipped":
        return "equivalent" if (output or "").startswith("equivalent") else "left out"
    if worker != "normal":
        return "incompetent"            # the worker itself failed (an exception, a crash): not a test verdict
    if test == "killed":
        if environmental(output):
            return "incompetent"        # the device, not a gate: run again with fewer workers (--retest)
        return "timeout" if output == "timeout" else "killed"
    return test or "incompetent"        # survived / incompetent


def summarize(module: str, mutants: list[dict], meta: dict) -> dict:
    """Counts, score and survivors of one module. `mutants`: dicts of operator, line, outcome ("pending" when not
    run), diff, why. Score: (killed + timeout) / (all run - equivalent); a timeout is the suite catching a hang."""
    counts = {k: 0 for k in ("killed", "survived", "timeout", "equivalent", "incompetent", "pending", "left out")}
    for m in mutants:
        counts[m["outcome"]] += 1
    judged = counts["killed"] + counts["survived"] + counts["timeout"]
    score = (counts["killed"] + counts["timeout"]) / judged if judged else None
    return dict(module=module, counts=counts, score=score, meta=meta,
                survivors=[m for m in mutants if m["outcome"] == "survived"],
                equivalent=[m for m in mutants if m["outcome"] == "equivalent"],
                incompetent=[m for m in mutants if m["outcome"] == "incompetent"],
                elsewhere=[m for m in mutants if m.get("elsewhere")])


def read_session(db_path: Path, module: str, entries: list[dict]) -> list[dict]:
    """The mutants of one session; a survivor the allow-list has gained since it ran counts as equivalent (matched
    against the module as it is now)."""
    from cosmic_ray.work_db import WorkDB, use_db
    source = (REPO / module).read_text() if (REPO / module).is_file() else ""
    out = []
    with use_db(str(db_path), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            m = item.mutations[0]
            verdict = outcome(result.worker_outcome.value, result.test_outcome and result.test_outcome.value,
                              result.output)
            why = (result.output or "").removeprefix("equivalent: ") if verdict == "equivalent" else ""
            if verdict == "survived" and source:
                line, mutant = mutant_lines(source, m.operator_name, m.occurrence, m.start_pos[0])
                why = equivalent_reason(entries, module, enclosing(source, m.start_pos[0]), m.operator_name, line,
                                        mutant) or ""
                verdict = "equivalent" if why else verdict
            note = result.output if verdict == "survived" and (result.output or "").startswith(UNREACHED) else ""
            if verdict == "incompetent" and environmental(result.output):
                note = f"no verdict: the suite ran out of device memory ({environmental(result.output)})"
            failed = re.search(r"^(?:FAILED|ERROR) (\S+)", result.output or "", re.M)
            out.append(dict(operator=m.operator_name, occurrence=m.occurrence, line=m.start_pos[0],
                            outcome=verdict, diff=result.diff or "", why=why, note=note,
                            test=failed[1] if failed and verdict == "killed" else None))
        for item in db.pending_work_items:
            m = item.mutations[0]
            out.append(dict(operator=m.operator_name, occurrence=m.occurrence, line=m.start_pos[0],
                            outcome="pending", diff="", why=""))
    return sorted(out, key=lambda m: (m["line"], m["operator"], m["occurrence"]))


def markdown(reports: list[dict]) -> str:
    lines = ["# Mutation campaign", "",
             "| module | killed | survived | timeout | equivalent | incompetent | not run | score | time | machine |"
             " commit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        c, meta = r["counts"], r["meta"]
        score = "-" if r["score"] is None else f"{100 * r['score']:.1f}%"
        lines.append(f"| `{r['module']}` | {c['killed']} | {c['survived']} | {c['timeout']} | {c['equivalent']} | "
                     f"{c['incompetent']} | {c['pending']} | {score} | {meta.get('seconds', 0) / 60:.1f} min | "
                     f"{meta.get('machine', '?')} | {meta.get('commit', '?')} |")
    lines += ["", "Score: (killed + timeout) / (killed + survived + timeout); equivalent mutants are left out, and so "
              "are incompetent ones (no verdict: the worker failed, or the suite ran out of device memory). "
              "A survivor of a module's own suite that its second suite kills (gates/mutation.toml [also]: the CPU "
              "gate run of a CUDA suite's module, run with --also) counts as killed, and is named below. "
              "Commands: gates/mutation.toml's suites (the gates' fast subsets)."]
    for r in reports:
        if r["meta"].get("command"):
            carried = r["meta"].get("carried")
            lines += ["", f"`{r['module']}`: `{r['meta']['command']}` (per-mutant timeout {r['meta']['timeout_s']} s,"
                      f" baseline {r['meta']['baseline_s']} s" + (f"; {carried} verdicts carried over from the "
                      "session before an edit of the module, from its unchanged functions" if carried else "") + ")"]
        for m in r["equivalent"]:
            lines += [f"- equivalent: `{r['module']}` line {m['line']}, {m['operator']}: {m['why']}"]
        for m in r.get("elsewhere", []):
            lines += [f"- killed by a second suite: `{r['module']}` line {m['line']}, {m['operator']} "
                      f"#{m['occurrence']}: {m['note']}"]
        for m in r.get("incompetent", []):
            lines += [f"- incompetent (run again: --resume --retest): `{r['module']}` line {m['line']}, {m['operator']}"
                      f" #{m['occurrence']}: {m.get('note') or 'the worker failed'}"]
        for m in r["survivors"]:
            lines += ["", f"### survivor: `{r['module']}` line {m['line']}, {m['operator']} #{m['occurrence']}", "",
                      "```diff", m["diff"].strip(), "```"]
            if m.get("note"):
                lines += ["", m["note"]]
    return "\n".join(lines) + "\n"


def report(work: Path, entries: list[dict], modules: list[str] | None = None) -> list[dict]:
    out = []
    for db in sorted(work.glob("*.sqlite")):
        if db.stem.endswith(".also") or db.stem.endswith(".before-edit"):
            continue                    # a second suite's session: merged into its module's below
        meta_path = work / f"{db.stem}.meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        module = meta.get("module", db.stem.replace(".", "/") + ".py")
        if modules and module not in modules:
            continue
        out.append(summarize(module, killed_elsewhere(work, module, read_session(db, module, entries)), meta))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gates.mutation", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run campaigns, then write the report")
    run.add_argument("--module", action="append", help="a module of gates/mutation.toml (repeatable)")
    run.add_argument("--suite", action="append", help="every module of this suite (repeatable)")
    run.add_argument("--max-minutes", type=float, default=60.0, help="total time cap; what is left is 'not run'")
    run.add_argument("--resume", action="store_true", help="go on with the sessions under --work (their pending "
                     "mutants); without it each module starts a new session")
    run.add_argument("--retest", action="store_true", help="with --resume: run the survivors again (a gap closed)")
    run.add_argument("--workers", type=int, default=1, help="mutants run at a time (cosmic-ray's http distributor, "
                     "a copy of the tree each)")
    run.add_argument("--also", action="store_true", help="the modules' survivors against their second suite "
                     "(gates/mutation.toml [also]); a kill there counts, named in the report")
    run.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: the cores "
                     "shared among the workers; set it where another campaign runs beside this one)")
    rep = sub.add_parser("report", help="write the report from the sessions under --work")
    for p in (run, rep):
        p.add_argument("--work", type=Path, default=WORK, help="sessions and metadata (default results/mutation)")
        p.add_argument("--markdown", type=Path, default=None, help="write the Markdown report here")
        p.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    cfg = load_config()
    args.work = args.work.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    modules = None
    if args.cmd == "run":
        modules = list(args.module or []) + [m for m, s in cfg["modules"].items() if s in (args.suite or [])]
        unknown = [m for m in modules if m not in cfg["modules"]]
        if unknown or not modules:
            ap.error(f"modules {unknown or '(none)'}: known: {', '.join(cfg['modules'])}")
        deadline = time.time() + 60 * args.max_minutes
        for m in modules:
            if time.time() >= deadline:
                print(f"{m}: not run (the {args.max_minutes} min cap was reached)", file=sys.stderr)
                continue
            if args.also and m not in cfg.get("also", {}):
                print(f"{m}: no second suite in gates/mutation.toml [also]", file=sys.stderr)
                continue
            meta = run_module(m, cfg, args.work, deadline, args.resume, args.retest, args.workers, args.threads,
                              also=args.also)
            print(f"{m}: {meta['seconds']:.0f} s{'' if meta['finished'] else ' (cap reached)'}", file=sys.stderr)
    reports = report(args.work, load_equivalent(REPO / cfg["equivalent"]), modules)
    text = markdown(reports)
    if args.markdown:
        args.markdown.write_text(text)
    if args.out:
        args.out.write_text(json.dumps(reports, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
