"""A mutation campaign's results (gates/mutation.py runs it): cosmic-ray's session databases, which mutants in them
run and which are skipped (outside the selective operator set, in the committed allow-list of equivalent mutants, on
statements the suite never reached), verdicts carried over an edit of the module, and the report read back from them
(per module: killed, survived, timed out, equivalent; every survivor with its diff)."""
from __future__ import annotations

import ast
import hashlib
import json
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "gates" / "mutation.toml"


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


def slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


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
