"""Planted bugs: the admission gate (gates/test_admission.py) must FAIL on each, naming the violated invariant.

Each bug is planted by subclassing PagePool or Scheduler (tests/plants.py; engine files stay untouched); the very
state machine of the gate runs against the bugged classes, with enough derandomized examples that hypothesis finds
every bug every time.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from engine.pool import PagePool
from engine.scheduler import Scheduler
from gates.admission_machine import PAGE_SIZES, make_machine
from tests.plants import (AcceptingPool, EagerFreePool, FlooringPool, OverfullScheduler, QueueJumpingScheduler,
                          SharedListsPool, SkippingArrivalsScheduler)

# Generation only: hypothesis stops at the first failing example and reports its message. (Shrinking is left to the
# gate itself; here it would only cost time.) Derandomized, so the search is the same on every run; each bug is found
# in well under max_examples (measured with random seeds: at most ~140 examples, typically under 60).
FIND = settings(max_examples=500, stateful_step_count=30, derandomize=True, database=None, deadline=None,
                report_multiple_bugs=False, suppress_health_check=list(HealthCheck), phases=[Phase.generate])


# A floored pages_needed breaks two checks at once: a request up to a page larger than the pool passes the never-fits
# check at submit, and an admitted request gets too few pages; hypothesis reports whichever example it meets first.
# Both messages name the invariant and the rounding (ceil((prompt + budget) / page_size) = pages).
PLANTED = {
    "reservation-rounded-down": (FlooringPool, Scheduler,
                                 r"^(reserve on admit|never fits) violated: .*ceil\(\(\d+ \+ \d+\) / \d+\) = \d+"),
    # the rule Engine.validate applies (PagePool.check_fits): the gate runs the engine's own rule, not a copy
    "never-fits-accepted": (AcceptingPool, Scheduler,
                            r"^never fits violated: r\d+ needs ceil\(\(\d+ \+ \d+\) / \d+\) = \d+ pages "
                            r".*accepted at submit"),
    "queue-jump": (PagePool, QueueJumpingScheduler, r"^strict FCFS admission violated: step \d+ admitted r\d+ .*while"),
    "arrivals-skip": (PagePool, SkippingArrivalsScheduler,
                      r"^strict FCFS admission violated: r\d+ is accepted submit number \d+ .*its arrival index is"),
    "free-during-step": (EagerFreePool, Scheduler,
                         r"^eviction at the end of the step violated: release\('r\d+'\) put pages straight back"),
    "beyond-max-batch": (PagePool, OverfullScheduler, r"^max batch violated: .* requests now hold rows, max_batch is"),
    "foresight-copy-shares-lists": (SharedListsPool, Scheduler,
                                    r"^the pages foreseen freed are the step's own violated: step \d+: "
                                    r"pages_freed_by\(\) changed the real pool"),
}


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_gate_fails_on_planted_bug(bug, page_size):
    pool_cls, scheduler_cls, message = PLANTED[bug]
    machine = make_machine(pool_cls, scheduler_cls, page_size)
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(machine, settings=FIND)


def test_the_drain_bound_counts_a_decoding_requests_steps():
    """The correct engine passes the example hypothesis found on the H200 (session 23): at chunk_tokens 1 a decoding
    request's cached positions run past its prompt, and the gate's bound on the steps left counted that as negative
    prompt chunks, which cancelled its decode steps: a bound of 0 and a false 'a hang'."""
    machine = make_machine(PagePool, Scheduler, page_size=1)()
    machine.setup(num_pages=8, max_batch=1, chunk_tokens=1)
    machine.submit(budget=6, k=7, offset=0)
    for _ in range(5):
        machine.end_step()
        machine.check_all()
    assert machine.outstanding_steps() >= 2     # one decode step left, and the step that finds nothing
    machine.drain()
    machine.teardown()
    assert all(m.done for m in machine.model.values())


def test_gate_fails_on_a_foresight_that_misses_a_freed_page(monkeypatch):
    """Planted in engine/foresight.py itself: pages_freed_by() leaves out the last page it finds; the admission gate
    compares what it foresaw with what the step's end freed."""
    from engine import foresight
    real = foresight.pages_freed_by
    monkeypatch.setattr(foresight, "pages_freed_by", lambda sched, plan: real(sched, plan)[:-1])
    with pytest.raises(AssertionError, match=r"^the pages foreseen freed are the step's own violated: step \d+: "
                                             r"pages_freed_by\(\) foresaw \[.*\] freed at the step's end, its "
                                             r"finish_step\(\) freed \[\d"):
        run_state_machine_as_test(make_machine(PagePool, Scheduler, 64), settings=FIND)
