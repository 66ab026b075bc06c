"""The mutation campaign's configuration and report (gates/mutation.py runs it, gates/mutation_results.py reads its
sessions): what it selects, how it reads cosmic-ray's verdicts, the score and the Markdown; the configuration names
only modules and gates that exist."""
from __future__ import annotations

import difflib
import shlex
import time
from pathlib import Path

import pytest

from gates import mutation, mutation_results as results

REPO = Path(__file__).resolve().parent.parent


def test_the_configured_modules_and_suites_exist():
    cfg = results.load_config()
    missing = [m for m in cfg["modules"] if not (REPO / m).is_file()]
    assert missing == [], f"gates/mutation.toml names modules that moved or went: {missing}"
    assert set(cfg["modules"].values()) <= set(cfg["suites"])
    for name, suite in cfg["suites"].items():
        paths = [w.split("::")[0] for w in shlex.split(suite["command"]) if w.startswith("gates/")]
        assert paths and all((REPO / p).is_file() for p in paths), f"suite {name}: {suite['command']}"
        assert suite["timeout"] > 0 and suite["device"] in ("cpu", "cuda")
    for module, name in cfg.get("also", {}).items():     # a second suite: another device's gate run of the module
        assert module in cfg["modules"] and name in cfg["suites"], (module, name)
        assert cfg["suites"][name]["device"] != cfg["suites"][cfg["modules"][module]]["device"], (module, name)


def test_the_committed_allow_list_reads_and_gives_each_mutant_a_reason():
    cfg = results.load_config()
    for e in results.load_equivalent(REPO / cfg["equivalent"]):
        assert e["module"] in cfg["modules"] and len(e["why"].split()) >= 5, e
        assert e["line"] in {line.strip() for line in (REPO / e["module"]).read_text().splitlines()}, (
            f"{e['module']} no longer has the line {e['line']!r}: the entry is stale")


def test_an_allow_list_entry_without_a_reason_is_refused(tmp_path):
    path = tmp_path / "eq.toml"
    path.write_text('[[equivalent]]\nmodule = "engine/pool.py"\nwhere = ""\noperator = "x"\nline = "a"\n'
                    'mutant = "b"\n')
    with pytest.raises(ValueError, match="why"):
        results.load_equivalent(path)


def test_selective_operators():
    assert results.selected("core/ReplaceBinaryOperator_Add_Sub")
    assert not results.selected("core/ReplaceBinaryOperator_Add_BitXor")
    assert results.selected("core/ReplaceComparisonOperator_Lt_LtE")
    assert results.selected("core/ReplaceComparisonOperator_Lt_GtE")
    assert not results.selected("core/ReplaceComparisonOperator_Lt_Eq")
    assert results.selected("core/ReplaceComparisonOperator_IsNot_Is")
    assert results.selected("core/NumberReplacer") and results.selected("core/ZeroIterationForLoop")


def test_equivalent_reason_matches_stripped_lines_in_their_place():
    entries = [dict(module="m.py", where="A.f", operator="op", line="x = 1", mutant="x = 2", why="nobody reads x")]
    assert results.equivalent_reason(entries, "m.py", "A.f", "op", "    x = 1", "    x = 2 ") == "nobody reads x"
    assert results.equivalent_reason(entries, "m.py", "A.f", "op", "x = 1", "x = 0") is None
    assert results.equivalent_reason(entries, "m.py", "B.f", "op", "x = 1", "x = 2") is None


def test_enclosing_names_the_class_and_function():
    source = ("X = 1\nclass A:\n    def f(self):\n        if X:\n            return 2\n    y = 3\n    @property\n"
              "    def h(self):\n        return 4\n")
    assert [results.enclosing(source, n) for n in (1, 5, 6, 7, 9)] == ["", "A.f", "A", "A.h", "A.h"]


@pytest.mark.parametrize("worker,test,output,expected", [
    ("normal", "killed", "FAILED gates/...", "killed"),
    ("normal", "killed", "timeout", "timeout"),
    ("normal", "survived", "5 passed", "survived"),
    ("normal", "incompetent", "Traceback", "incompetent"),
    ("exception", None, "Traceback", "incompetent"),
    ("skipped", None, "equivalent: never read", "equivalent"),
    ("skipped", None, results.LEFT_OUT, "left out"),
])
def test_outcome(worker, test, output, expected):
    assert results.outcome(worker, test, output) == expected


def mutants(*outcomes):
    return [dict(operator="core/NumberReplacer", occurrence=i, line=10 + i, outcome=o,
                 diff=f"--- a\n+++ b\n-x = {i}\n+x = {i + 1}", why="never read" if o == "equivalent" else "")
            for i, o in enumerate(outcomes)]


def test_summarize_scores_killed_and_timeouts_over_the_non_equivalent():
    r = results.summarize("engine/pool.py", mutants("killed", "killed", "timeout", "survived", "equivalent",
                                                     "pending", "left out"), {})
    assert r["counts"] == {"killed": 2, "survived": 1, "timeout": 1, "equivalent": 1, "incompetent": 0,
                           "pending": 1, "left out": 1}
    assert r["score"] == pytest.approx(3 / 4)
    assert [m["line"] for m in r["survivors"]] == [13]
    assert results.summarize("m.py", mutants("pending"), {})["score"] is None


def test_markdown_lists_every_survivor_with_its_diff():
    meta = dict(seconds=600, machine="vm, 2 cores", commit="abc1234", command="python -m pytest -x gates/x.py",
                timeout_s=150, baseline_s=20.0)
    text = results.markdown([results.summarize("engine/pool.py", mutants("killed", "survived", "survived"),
                                                 meta)])
    assert "| `engine/pool.py` | 1 | 2 | 0 | 0 | 0 | 0 | 33.3% | 10.0 min | vm, 2 cores | abc1234 |" in text
    assert text.count("### survivor: `engine/pool.py`") == 2
    assert "+x = 2" in text and "+x = 3" in text and "python -m pytest -x gates/x.py" in text


def test_mutant_lines_name_the_original_and_the_mutated_line():
    pytest.importorskip("cosmic_ray", reason="cosmic-ray is the mutation extra (pip install -e '.[mutation]')")
    source = "def f(a, b):\n    return a + b\n"
    assert results.mutant_lines(source, "core/ReplaceBinaryOperator_Add_Sub", 0, 2) == ("return a + b",
                                                                                         "return a - b")
    assert results.mutant_lines("@d\ndef f():\n    pass\n", "core/RemoveDecorator", 0, 1) == ("@d", "(removed)")


def test_every_allow_list_entry_names_a_mutant_the_tool_makes_today():
    """An entry whose line moved away or changed (a refactor) would silently stop matching: each entry must still name
    a mutant of its module as it is now (place, operator, original and mutated line)."""
    pytest.importorskip("cosmic_ray", reason="cosmic-ray is the mutation extra (pip install -e '.[mutation]')")
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator
    config = results.load_config()
    stale = []
    for e in results.load_equivalent(REPO / config["equivalent"]):
        source = (REPO / e["module"]).read_text()
        before = source.splitlines()
        made = set()
        for occurrence in range(500):
            mutated = mutate_code(source, get_operator(e["operator"])(), occurrence)
            if mutated is None:
                break
            after = mutated.splitlines()
            # the changed line; a removed decorator takes blank lines with it (the tool rewrites around it)
            _, start, end, j, _ = next(op for op in difflib.SequenceMatcher(None, before, after, autojunk=False)
                                       .get_opcodes() if op[0] != "equal")
            i = next(k for k in range(start, end) if before[k].strip())
            mutant = "(removed)" if len(after) < len(before) else after[j + i - start].strip()
            made.add((results.enclosing(source, i + 1), before[i].strip(), mutant))
        if (e["where"], e["line"], e["mutant"]) not in made:
            stale.append(f"{e['module']} {e['where']!r} {e['operator']}: {e['line']!r} -> {e['mutant']!r}")
    assert not stale, "allow-list entries that name no mutant of today's code:\n" + "\n".join(stale)


def test_the_nightly_workflow_campaigns_every_cpu_module():
    yaml = pytest.importorskip("yaml")
    cfg = results.load_config()
    cpu = [m for m, s in cfg["modules"].items() if cfg["suites"][s]["device"] == "cpu"]
    wf = yaml.safe_load((REPO / ".github/workflows/mutation.yml").read_text())
    assert wf["jobs"]["cpu"]["strategy"]["matrix"]["module"] == cpu


def session(path, results):
    """A session database with cosmic-ray's two tables (work_items, work_results), `results`: job id -> (worker,
    test outcome) or None (pending)."""
    import sqlite3
    with sqlite3.connect(path) as c:
        c.execute("CREATE TABLE work_items (job_id VARCHAR PRIMARY KEY)")
        c.execute("CREATE TABLE work_results (worker_outcome VARCHAR, output TEXT, test_outcome VARCHAR, diff TEXT, "
                  "job_id VARCHAR PRIMARY KEY)")
        for job, res in results.items():
            c.execute("INSERT INTO work_items VALUES (?)", (job,))
            if res:
                c.execute("INSERT INTO work_results VALUES (?, '', ?, '', ?)", (res[0], res[1], job))


def test_retest_runs_the_survivors_alone_then_restores_the_rest(tmp_path):
    db = tmp_path / "s.sqlite"
    session(db, {"k": ("NORMAL", "KILLED"), "s1": ("NORMAL", "SURVIVED"), "s2": ("NORMAL", "SURVIVED"),
                 "p1": None, "p2": None, "p3": None})
    assert results.pending(db) == 3
    results.retest_survivors(db)
    assert results.pending(db) == 2            # s1 and s2 alone: what cosmic-ray exec would run now
    results.restore_deferred(db)
    assert results.pending(db) == 5            # the never-run ones pending again (and the survivors, not rerun here)


def toy_repo(tmp_path: Path) -> Path:
    """A git checkout of one small module and a check that kills some of its mutants and not others (`a < b` ->
    `a <= b` survives: no call compares equal values)."""
    import subprocess
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "toy.py").write_text("def f(a, b):\n    if a < b:\n        return a + b\n    return b - a\n")
    (repo / "allow.toml").write_text("")
    for cmd in (["git", "init", "-q"], ["git", "add", "."],
                ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "toy"]):
        subprocess.run(cmd, cwd=repo, check=True)
    return repo


def test_a_survivor_its_second_suite_kills_counts_as_killed_and_is_named(tmp_path, monkeypatch):
    """--also runs a module's survivors (its own suite's session) against its second suite, in a session of their
    own: a mutant that suite kills is reported killed, with the suite and the failing test named; one it does not
    kill stays a survivor; the other mutants are not run again; an edit of the module since refuses the run."""
    pytest.importorskip("cosmic_ray")
    repo = toy_repo(tmp_path)
    monkeypatch.setattr(mutation, "REPO", repo)
    monkeypatch.setattr(results, "REPO", repo)      # read_session reads the module there
    (repo / "test_toy.py").write_text("import toy\n\ndef test_equal():\n    assert toy.f(2, 2) == 0\n")
    cfg = {"operators": "selective", "equivalent": "allow.toml", "modules": {"toy.py": "toy"}, "also": {"toy.py": "cpu2"},
           "suites": {"toy": {"device": "cuda", "timeout": 60,
                              "command": "python -c 'import toy; assert toy.f(1, 2) == 3 and toy.f(5, 2) == -3'"},
                      "cpu2": {"device": "cpu", "timeout": 60, "command": "python -m pytest -x -q test_toy.py"}}}
    work = tmp_path / "work"
    work.mkdir()
    mutation.run_module("toy.py", cfg, work, deadline=time.time() + 300)
    own = results.read_session(work / "toy.sqlite", "toy.py", [])
    assert [m["line"] for m in own if m["outcome"] == "survived"] == [2]      # a < b -> a <= b
    meta = mutation.run_module("toy.py", cfg, work, deadline=time.time() + 300, also=True)
    assert meta["suite"] == "cpu2" and meta["finished"]
    also = results.read_session(work / "toy.also.sqlite", "toy.py", [])
    assert [m["outcome"] for m in also if m["outcome"] not in ("left out",)] == ["killed"]   # the survivor alone ran
    [r] = results.report(work, [])
    assert r["counts"]["survived"] == 0 and r["score"] == 1.0, r["counts"]
    assert len(r["elsewhere"]) == 1 and "cpu2 suite" in r["elsewhere"][0]["note"]
    assert "test_toy.py::test_equal" in r["elsewhere"][0]["note"]
    assert "killed by a second suite: `toy.py` line 2" in results.markdown([r])

    (repo / "test_toy.py").write_text("import toy\n\ndef test_nothing():\n    assert toy.f(1, 2) == 3\n")
    mutation.run_module("toy.py", cfg, work, deadline=time.time() + 300, also=True)
    [r] = results.report(work, [])
    assert r["counts"]["survived"] == 1 and not r["elsewhere"]                # not killed there: still a survivor

    (repo / "toy.py").write_text((repo / "toy.py").read_text() + "\n\ndef g():\n    return 1\n")
    with pytest.raises(RuntimeError, match="changed since"):
        mutation.run_module("toy.py", cfg, work, deadline=time.time() + 300, also=True)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_campaign_with_workers_gives_the_verdicts_of_one_at_a_time(tmp_path, monkeypatch, workers):
    """--workers runs mutants through cosmic-ray's http distributor, each worker in its own copy of the tree: the
    verdicts are those of the local run (the toy module's mutants: the check kills all but the boundary one)."""
    pytest.importorskip("cosmic_ray")
    repo = toy_repo(tmp_path)
    monkeypatch.setattr(mutation, "REPO", repo)
    monkeypatch.setattr(results, "REPO", repo)      # read_session reads the module there
    check = "python -c 'import toy; assert toy.f(1, 2) == 3 and toy.f(5, 2) == -3'"
    cfg = {"operators": "selective", "equivalent": "allow.toml", "modules": {"toy.py": "toy"},
           "suites": {"toy": {"device": "cpu", "timeout": 60, "command": check}}}
    work = tmp_path / "work"
    work.mkdir()
    meta = mutation.run_module("toy.py", cfg, work, deadline=time.time() + 300, workers=workers)
    assert meta["finished"] and meta["workers"] == workers
    verdicts = {(m["line"], m["operator"], m["occurrence"]): m["outcome"]
                for m in results.read_session(work / "toy.sqlite", "toy.py", [])}
    survived = [k for k, v in verdicts.items() if v == "survived"]
    assert [k[:2] for k in survived] == [(2, "core/ReplaceComparisonOperator_Lt_LtE")], verdicts
    assert sum(v == "killed" for v in verdicts.values()) >= 3, verdicts
    assert not list(work.glob("toy.tree*")), "the copies of the tree are removed after the run"


def test_cosmic_rays_http_client_waits_as_long_as_the_suite_may_run():
    """aiohttp's default client timeout (300 s in all) would turn a mutant whose suite runs longer on a loaded
    machine into an error: the CLI cosmic-ray runs under lifts it for every session aiohttp makes."""
    pytest.importorskip("aiohttp")
    import subprocess
    import sys
    probe = mutation.CLI.split("from cosmic_ray")[0] + (
        "import asyncio, aiohttp\n"
        "async def t():\n"
        "    async with aiohttp.ClientSession() as s: print(s.timeout.total, s.timeout.sock_connect)\n"
        "asyncio.run(t())")
    out = subprocess.run([sys.executable, "-c", probe.replace("; ", "\n")], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["None", "30"], out.stderr


def test_a_session_of_an_edited_module_is_not_resumed(tmp_path):
    meta = tmp_path / "m.meta.json"
    assert not mutation.edited_since(meta, "abc")                   # no session yet: nothing to resume anyway
    meta.write_text('{"seconds": 3}')
    assert not mutation.edited_since(meta, "abc")                   # made before hashes were kept
    meta.write_text('{"seconds": 3, "module_sha": "abc"}')
    assert not mutation.edited_since(meta, "abc")
    assert mutation.edited_since(meta, "abd")
    assert len(mutation.module_sha("engine/pool.py")) == 16


def test_statement_line_finds_the_first_line_of_a_continued_statement():
    source = "x = 1\nif x:\n    y = (x +\n         2)\n"
    assert [results.statement_line(source, n) for n in (1, 2, 3, 4)] == [1, 2, 3, 3]


def test_a_reach_suite_records_mutants_on_unrun_statements_as_survivors_without_running_them(tmp_path, monkeypatch):
    """reach = true: the suite's unmutated run under coverage.py; `return b - a` is never run by the toy's test, so
    its mutant is a survivor with the note that says why, and is not run; the reached ones are run and killed."""
    pytest.importorskip("cosmic_ray")
    pytest.importorskip("coverage")
    import subprocess
    repo = toy_repo(tmp_path)
    (repo / "test_toy.py").write_text("import toy\n\ndef test_f():\n    assert toy.f(1, 2) == 3\n")
    subprocess.run(["git", "add", "."], cwd=repo, check=True)
    monkeypatch.setattr(mutation, "REPO", repo)
    monkeypatch.setattr(results, "REPO", repo)      # read_session reads the module there
    cfg = {"operators": "selective", "equivalent": "allow.toml", "modules": {"toy.py": "toy"},
           "suites": {"toy": {"device": "cpu", "timeout": 60, "reach": True,
                              "command": "python -m pytest -q -p no:cacheprovider test_toy.py"}}}
    work = tmp_path / "work"
    work.mkdir()
    meta = mutation.run_module("toy.py", cfg, work, deadline=time.time() + 300)
    assert meta["finished"]
    mutants = results.read_session(work / "toy.sqlite", "toy.py", [])
    unreached = [m for m in mutants if m["note"]]
    assert unreached and {m["line"] for m in unreached} == {4}, mutants
    assert all(m["outcome"] == "survived" and "line 4" in m["note"] for m in unreached)
    assert any(m["line"] == 3 and m["outcome"] == "killed" for m in mutants), mutants
    assert "never ran this statement" in results.markdown([results.summarize("toy.py", mutants, meta)])


def test_a_reach_suite_must_run_pytest_under_python():
    with pytest.raises(ValueError, match="python -m pytest"):
        mutation.under_coverage(["bash", "run.sh"], Path("d"), Path("."), ["m.py"])


def test_a_units_key_holds_across_lines_moved_and_changes_with_its_text():
    before = "def f(a, b):\n    return a + b\n\n\nclass C:\n    def m(self):\n        return 1 + 2\n"
    after = "import os\n\n" + before.replace("return 1 + 2", "return 1 - 2")
    old, new = results.units(before), results.units(after)
    op = "core/NumberReplacer"
    assert results.unit_key(old, op, (2, 11)) == results.unit_key(new, op, (4, 11))     # f moved two lines down
    assert results.unit_key(old, op, (2, 11)) != results.unit_key(new, op, (4, 12))     # another column
    assert results.unit_key(old, op, (7, 15)) != results.unit_key(new, op, (9, 15))     # C.m's text changed
    assert results.unit_key(old, op, (5, 0)) == results.unit_key(new, op, (7, 0))       # the class line, unchanged


def test_an_edited_modules_session_keeps_the_verdicts_of_its_unchanged_functions(tmp_path, monkeypatch):
    """--resume after an edit: the mutants of unchanged functions keep their verdicts (not run again: the boundary
    survivor stays a survivor though the new check would kill it), the edited or new function's mutants run; then
    --retest runs the survivors against the new check. The session's source is kept for the next edit, and a
    session from before it was kept finds its source in git history by its hash."""
    pytest.importorskip("cosmic_ray")
    repo = toy_repo(tmp_path)
    monkeypatch.setattr(mutation, "REPO", repo)
    monkeypatch.setattr(results, "REPO", repo)      # read_session reads the module there
    work = tmp_path / "work"
    work.mkdir()

    def cfg(check):
        return {"operators": "selective", "equivalent": "allow.toml", "modules": {"toy.py": "toy"},
                "suites": {"toy": {"device": "cpu", "timeout": 60, "command": f"python -c 'import toy; {check}'"}}}
    first = "assert toy.f(1, 2) == 3 and toy.f(5, 2) == -3"
    mutation.run_module("toy.py", cfg(first), work, deadline=time.time() + 300)
    before = {(m["line"], m["operator"], m["occurrence"]): m["outcome"]
              for m in results.read_session(work / "toy.sqlite", "toy.py", [])}
    kept = work / "toy.source.py"
    assert kept.read_text() == (repo / "toy.py").read_text()
    kept.unlink()                                   # as a session made before the source was kept
    sha = mutation.module_sha("toy.py")
    assert mutation.session_source(work, "toy.py", sha) == (repo / "toy.py").read_text()     # from git

    (repo / "toy.py").write_text("def g(x):\n    return x * 3\n\n\n" + (repo / "toy.py").read_text())
    second = "assert toy.f(1, 2) == 3 and toy.f(5, 2) == -3 and toy.f(2, 2) == 0 and toy.g(2) == 6"
    meta = mutation.run_module("toy.py", cfg(second), work, deadline=time.time() + 300, resume=True)
    assert meta["finished"] and meta["carried"] == len([v for v in before.values() if v != "left out"]), meta
    after = results.read_session(work / "toy.sqlite", "toy.py", [])
    assert {(m["line"] - 4, m["operator"], m["occurrence"]): m["outcome"] for m in after if m["line"] > 4} == before
    assert [m["line"] for m in after if m["outcome"] == "survived"] == [6]   # carried, not run against f(2, 2)
    assert all(m["outcome"] in ("killed", "left out") for m in after if m["line"] <= 2), after   # g's: run
    assert mutation.session_source(work, "toy.py", mutation.module_sha("toy.py")) == (repo / "toy.py").read_text()

    import sqlite3
    with sqlite3.connect(work / "toy.sqlite") as c:      # a mutant never run (a campaign cut at its cap)
        c.execute("DELETE FROM work_results WHERE job_id = (SELECT job_id FROM work_results WHERE test_outcome = "
                  "'KILLED' LIMIT 1)")
    assert results.pending(work / "toy.sqlite") == 1
    meta = mutation.run_module("toy.py", cfg(second), work, deadline=time.time() + 300, resume=True, retest=True)
    assert not [m for m in results.read_session(work / "toy.sqlite", "toy.py", []) if m["outcome"] == "survived"]
    # the survivors first, then the never-run one in the time left: one call leaves nothing pending
    assert meta["finished"] and results.pending(work / "toy.sqlite") == 0


def test_workers_are_capped_by_what_the_device_holds_of_the_suite():
    runner = {"device": "cuda", "worker_gib": 16}
    assert mutation.worker_cap(runner, 13, 139.8) == 8        # session 18: 13 on one H200 ran out of memory
    assert mutation.worker_cap(runner, 4, 139.8) == 4
    assert mutation.worker_cap(runner, 13, 8.0) == 1
    assert mutation.worker_cap({"device": "cuda"}, 13, 139.8) == 13      # no figure: as asked
    assert mutation.worker_cap(runner, 13, None) == 13                   # no device to ask


@pytest.mark.parametrize("output,cause", [
    ("FAILED gates/test_tokens.py::test_determinism[flash-flash] - torch.OutOfMemoryError: CUDA out of memory.",
     "OutOfMemoryError"),
    ("FAILED gates/test_graphs.py::x - engine.errors.PoolTooLargeError: kv_cache_bytes=None: 1025 pages of 256 slots "
     "take 0.5 GiB of KV cache on this model (524288 bytes a page), more than the 0.0194 GiB free on cuda: give fewer",
     "PoolTooLargeError: kv_cache_bytes=None: 1025 pages of 256 slots take 0.5 GiB of KV cache on this model (524288 "
     "bytes a page), more than the 0.0194 GiB free on cuda"),
    ("FAILED gates/test_smoke.py::test_smoke[chunked-torch] - ZeroDivisionError\nlater: CUDA out of memory", None),
    ("FAILED gates/test_smoke.py::test_smoke[flash-flash] - AssertionError: tokens differ", None),
])
def test_a_suite_out_of_device_memory_gives_no_verdict(output, cause):
    """The first failure decides: out of device memory (a dozen workers on one GPU) is the machine's, not the
    mutant's; the run counts as incompetent (no verdict) and --retest runs it again."""
    assert results.environmental(output) == cause
    assert results.outcome("normal", "killed", output) == ("incompetent" if cause else "killed")


def test_retest_runs_again_what_ran_out_of_device_memory(tmp_path):
    import sqlite3
    db = tmp_path / "s.sqlite"
    session(db, {"k": ("NORMAL", "KILLED"), "oom": ("NORMAL", "KILLED"), "p": None})
    with sqlite3.connect(db) as c:
        c.execute("UPDATE work_results SET output = 'FAILED x - torch.OutOfMemoryError: CUDA out of memory' "
                  "WHERE job_id = 'oom'")
    results.retest_survivors(db)
    assert results.pending(db) == 1            # the run without a verdict, alone
    results.restore_deferred(db)
    assert results.pending(db) == 2
