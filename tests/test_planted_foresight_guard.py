"""Planted weakenings of the engine's guard on a step launched ahead (engine/foresight.py: matches) that the smoke
gate's wrong-foresight check (gates/foresight_guard.py, run by gates/test_smoke.py) must catch: each is what a
mutation campaign left alive before that check existed. The unplanted guard passes it."""
from __future__ import annotations

import pytest

from engine import Engine, PoisonedLogitsError
from engine.workload import SMOKE_CPU
from gates.foresight_guard import guard_problems
from gates.reference import EngineReference


def weakened_rows(step, plan) -> bool:
    """Rows compared by position alone: `a.request is r and ...` made `or`."""
    return (not plan.admitted and len(step.chunks) == len(plan.chunks) and len(step.rows) == len(plan.decodes)
            and all(a.request is c.request and a.start == c.start and a.length == c.length
                    for a, c in zip(step.chunks, plan.chunks))
            and all(a.request is r or a.num_cached == r.num_cached for a, r in zip(step.rows, plan.decodes)))


def nothing_admitted_is_enough(step, plan) -> bool:
    """`not plan.admitted and ...` made `or`: any launch is used when nobody was admitted."""
    return not plan.admitted or len(step.rows) == len(plan.decodes)


def check(monkeypatch, matches=None):
    ref = EngineReference("fused", poison=True, chunk_tokens=SMOKE_CPU.chunk_tokens, cuda_graphs=True, overlap=True)
    right = ref.engine()
    specs = SMOKE_CPU.requests()[5:8]      # prompts of 129, 255 and 256 positions: two chunks each
    right.run(specs)
    if matches is not None:
        monkeypatch.setattr(Engine, "matches", staticmethod(matches))
    return guard_problems(ref, right, specs, "planted")


def test_the_engine_passes(monkeypatch):
    problems, ways = check(monkeypatch)
    assert not problems and all(ways.values()), (problems, ways)


@pytest.mark.parametrize("matches", [weakened_rows, nothing_admitted_is_enough])
def test_a_weakened_guard_fails(monkeypatch, matches):
    try:
        problems, ways = check(monkeypatch, matches)
    except IndexError as e:         # a launch with a row fewer than the step, read back for every row
        assert "index" in str(e)
        return
    except PoisonedLogitsError as e:    # a launch of a chunk a position shorter used: the next step reads that slot
        assert "never-written" in str(e)
        return
    assert any("a launch of a wrong foresight was used" in p for p in problems), problems
