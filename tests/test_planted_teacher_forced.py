"""Planted bugs in teacher forcing (Engine.score) that the smoke gate's teacher-forced check
(gates/teacher_forced.py, run by gates/test_smoke.py) must catch, naming the request, the position and both tokens;
and the unplanted engine passes it."""
from __future__ import annotations

import pytest

from engine import packing
from gates.golden import golden_path, read_golden
from gates.reference import EngineReference
from gates.teacher_forced import teacher_forced
from engine.workload import SMOKE_CPU


@pytest.fixture(scope="module")
def golden():
    records, _ = read_golden(golden_path(None, "small", SMOKE_CPU.name, "hf", "cpu", "float32"))
    return records


def check(golden):
    e = EngineReference("fused", poison=True).engine()
    return teacher_forced("planted", e, golden, 0.02, 3)


def test_the_unplanted_engine_passes(golden):
    report = check(golden)
    assert report.ok, report.problems()
    assert sum(len(g.tokens) for g in golden.values()) > 0


def plant(monkeypatch, change):
    """engine.packing.pack as the runner calls it (positionally), then `change(rows, nrows)` on the logit rows of a
    forward that asks for every position's logits (Engine.score's)."""
    pack = packing.pack

    def bugged(*args):
        o, nrows = pack(*args)
        if args[8]:                 # all_logits
            change(args[7], nrows)
        return o, nrows
    monkeypatch.setattr("engine.runner.pack", bugged)


def test_every_logit_row_one_position_late_fails(golden, monkeypatch):
    """score()'s logit rows each one position late (the last repeated): each emitted position judged by the next
    position's logits."""
    def late(rows, n):
        rows[:n - 1] = rows[1:n].copy()
    plant(monkeypatch, late)
    report = check(golden)
    assert not report.ok
    msg = "\n".join(report.problems())
    assert "not a near tie under 0.02" in msg and "position" in msg.lower(), msg


def test_logit_rows_never_written_fail(golden, monkeypatch):
    """Every all-logits row left at the forward's first position (rows never written past the first: what the
    campaign's surviving mutant, an empty slice assigned, leaves where the array held zeros)."""
    def first(rows, n):
        rows[:n] = rows[0]
    plant(monkeypatch, first)
    report = check(golden)
    assert not report.ok and report.failures, report.problems()
