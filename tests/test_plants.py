"""The planted-bug harness: the plugin plants a named bug for a whole gate run and records the first failure; the
plant table classifies a run as caught by a gate, caught by the session, or not caught."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import plants

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import plant_table  # noqa: E402


def pytest_run(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "pytest", *args, "-q", "-p", "no:cacheprovider"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_every_plant_plants_something_or_changes_the_command():
    for name, p in plants.PLANTS.items():
        assert p.patch is not None or p.args, name
        assert p.cause, name


def test_unknown_plant_is_a_usage_error():
    p = pytest_run("gates/test_smoke.py", "-p", "tests.plants", "--plant", "rotery")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "--plant 'rotery': unknown plant; known: rotary, cache-len" in p.stderr


def test_a_plant_is_in_place_before_the_options_are_read():
    """The simulated GPU machine without flash-attn: the options must see a CUDA device (else the run stops on
    "sees no CUDA device" instead) and then refuse the missing backend with its reason."""
    p = pytest_run("gates/test_smoke.py", "-p", "tests.plants", "--plant", "missing-backend", "--device", "cuda")
    assert p.returncode == 4, p.stdout + p.stderr
    assert "every selected attention backend must run on CUDA" in p.stderr and \
        "  flash: flash-attn does not import" in p.stderr, p.stderr


def test_the_smoke_gate_catches_a_planted_rotary_bug_and_the_table_says_so(tmp_path, monkeypatch):
    """One real planted run, end to end: the plugin plants the bug, the smoke gate fails, the record names it."""
    smoke_only = plants.Plant("rotary, smoke gate only", r"smoke: fused\[torch\] vs hf", plants.rotary,
                              paths=("gates/test_smoke.py::test_smoke[fused-torch]",))
    monkeypatch.setitem(plants.PLANTS, "rotary", smoke_only)
    r = plant_table.run_row(plant_table.Row("rotary", "rotary"), timeout=600, log_dir=tmp_path)
    log = next(tmp_path.glob("*.log")).read_text()
    assert r.caught and r.gate == "gates/test_smoke.py::test_smoke[fused-torch]", log[-3000:]
    assert r.named and r.exit == 1 and 0 < r.cpu < r.seconds + 60
    assert "not a near tie under 0.02" in log
    row = plant_table.markdown([r], "header").splitlines()[-1]
    assert row.startswith("| `rotary` | rotary, smoke gate only | `gates/test_smoke.py::test_smoke[fused-torch]` |")


@pytest.mark.parametrize("rc,gate,caught", [(0, "not caught", False), (4, "(session, exit 4)", True),
                                            ("timeout", "not caught (timed out)", False)])
def test_a_run_without_a_failing_report_is_classified_by_its_exit(rc, gate, caught):
    r = plant_table.classify(plant_table.Row("typo", "typo"), None, rc, "ERROR: --engine 'fussed': unknown engine; "
                             "known: chunked, fused, flash", 0.0, 12.0, 3.0)
    assert (r.gate, r.caught) == (gate, caught)
    assert r.named is (True if caught else None)
