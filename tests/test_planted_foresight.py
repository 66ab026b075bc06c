"""Planted bugs in the scheduler's foresight (Scheduler.next_step; survivors of the mutation campaign,
docs/mutation.md): the admission machine's foresight check (gates/foresight_check.py) must fail on each, naming the
steps and what was foreseen. A wrong foresight passes every token gate (the engine drops the launch) and a timid one
serializes steps quietly: only this check sees them at the bookkeeping level."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis.stateful import run_state_machine_as_test

from engine.request import State
from engine.scheduler import Foresight, Scheduler
from gates.admission_machine import make_machine

from tests.test_planted_admission import FIND


class GivesUpWhileFilling(Scheduler):
    """Foresees nothing while a prompt is still filling (the mutant `prefill_share <= 1.0`)."""

    def next_step(self, plan):
        if any(r.state is State.PREFILL for r in self.running):
            return None
        return super().next_step(plan)


class OneAheadForesight(Scheduler):
    """Foresees each decode row one position too far (a wrong NextRow position)."""

    def next_step(self, plan):
        f = super().next_step(plan)
        return f and Foresight(f.chunks, [replace(r, num_cached=r.num_cached + 1) for r in f.rows])


class ForgetsLastTokens(Scheduler):
    """Drops the rows whose next token is their last (the mutant `len(r.output) + 1 >= r.budget` turned around)."""

    def next_step(self, plan):
        f = super().next_step(plan)
        return f and Foresight(f.chunks, [r for r in f.rows if len(r.request.output) + 2 < r.request.budget])


@pytest.mark.parametrize("scheduler_cls,message", [
    (GivesUpWhileFilling, r"next_step\(\) foresaw nothing, but step \d+ admitted nobody"),
    (OneAheadForesight, r"next_step\(\) foresaw chunks .* and decode rows \(request, position\)"),
    (ForgetsLastTokens, r"next_step\(\) foresaw chunks .* and decode rows \(request, position\)"),
])
def test_admission_machine_fails_on_a_wrong_foresight(scheduler_cls, message):
    with pytest.raises(AssertionError, match=r"^the step foreseen is the step scheduled violated: step \d+: " + message):
        run_state_machine_as_test(make_machine(scheduler_cls=scheduler_cls, page_size=4), settings=FIND)
