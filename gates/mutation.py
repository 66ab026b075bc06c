"""The mutation campaign: cosmic-ray mutates one module at a time in a copy of the tree and runs the module's suite
of gates (gates/mutation.toml) once per mutant; this module drives it and writes the report (per module: killed,
survived, timed out, equivalent, time; every survivor with its diff), Markdown for a CI summary and JSON for history.

    python -m gates.mutation run --module engine/pool.py [--module ...] [--max-minutes 60]
    python -m gates.mutation run --module engine/runner.py --also    # its survivors against its second suite
    python -m gates.mutation report [--markdown mutation.md] [--out mutation.json]

Mutants in the committed allow-list (gates/mutation_equivalent.toml: the original line, the mutated line, why they
are equivalent) are marked skipped in cosmic-ray's session before it runs, and reported as equivalent. What a session
holds and the report read from it: gates/mutation_results.py. docs/mutation.md has the recipe and the reasons for the
choices here."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .mutation_results import (REPO, carry_over, filter_session, keep_only, load_config, load_equivalent,
                               mark_unreached, markdown, pending, read_session, report, restore_deferred,
                               retest_survivors, slug)

WORK = REPO / "results" / "mutation"


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
