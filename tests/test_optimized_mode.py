"""The planted bugs are caught under `python -O` too. -O drops every assert that pytest does not rewrite (it rewrites
test modules, conftest files and plugins only), so gate checks in library modules raise GateFailure
(gates/failure.py) instead of asserting."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Library modules whose checks the gates and the planted-bug tests rely on (tests/plants.py is imported by tests as a
# plain module, not only loaded as a plugin).
CHECKED = [p for p in sorted((REPO / "gates").glob("*.py")) if not p.name.startswith("test_") and
           p.name != "conftest.py"] + [REPO / "tests" / "plants.py"]

# Every planted bug whose gate check was an assert in a library module (docs/plants.md lists the gate-run plants)
CHECKS_THAT_WERE_ASSERTS = [
    "tests/test_planted_prefill_share.py::test_debt_that_never_saturates_is_caught",      # gates/prefill_share_check
    "tests/test_planted_prefill_share.py::test_debt_that_counts_no_decoders_is_caught",
    "tests/test_planted_prefill_share.py::test_last_long_piece_paid_after_is_caught",
    "tests/test_planted_prefix.py::test_eviction_watch_fails_on_an_evicted_page_left_unpoisoned",    # gates/prefix
    "tests/test_planted_tp.py::test_worker_that_does_not_poison_is_caught",                       # gates/tp
    "tests/test_planted_slowdown.py::test_ratio_check_passes_and_fails_by_the_medians",           # gates/ratio
]
PLANTED_FILES = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_planted_*.py")) + [
    "tests/test_plants.py", "tests/test_schedule_check.py"]


def optimized_pytest(*args) -> subprocess.CompletedProcess:
    """pytest under -O: PYTHONOPTIMIZE rather than the flag, so the processes it starts (the gate runs of
    tests/test_plants.py, tensor-parallel workers) run optimized too."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONOPTIMIZE="1")
    probe = subprocess.run([sys.executable, "-c", "assert False"], env=env, capture_output=True, text=True)
    assert probe.returncode == 0, f"asserts still on with PYTHONOPTIMIZE=1: {probe.stderr}"
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-m", "not slow and not gpu", "-q",
                           "-p", "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(REPO)))
def test_no_library_check_is_an_assert(path):
    lines = [n.lineno for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Assert)]
    assert not lines, (f"{path.relative_to(REPO)}: assert at lines {lines}, which `python -O` drops: raise "
                       f"gates.failure.GateFailure (a check) or ValueError (a bad argument)")


def test_planted_bugs_of_former_asserts_are_caught_under_O():
    r = optimized_pytest(*CHECKS_THAT_WERE_ASSERTS)
    assert r.returncode == 0, f"under -O a planted bug went uncaught:\n{r.stdout[-6000:]}{r.stderr[-2000:]}"


@pytest.mark.slow
def test_every_planted_bug_is_caught_under_O():
    r = optimized_pytest(*PLANTED_FILES)
    assert r.returncode == 0, f"under -O a planted bug went uncaught:\n{r.stdout[-6000:]}{r.stderr[-2000:]}"
