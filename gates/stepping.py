"""What the scheduler state machines share (gates/test_admission.py, gates/prefix_machine.py): invariant-naming checks,
and the driving of steps: a step stays open after its work until it is ended, so that cancellations can land in the
middle of one; a drain steps until all work is done; the invariants run after every rule; teardown drains."""
from __future__ import annotations

from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from engine.request import State

from .failure import GateFailure

PHASE_OF = {State.WAITING: "waiting", State.PREFILL: "prefill", State.DECODE: "decode",
            State.FINISHED: "finished", State.CANCELLED: "cancelled"}


def violated(invariant_name: str, detail: str) -> GateFailure:
    return GateFailure(f"{invariant_name} violated: {detail}")


def check(ok: bool, invariant_name: str, detail) -> None:
    """Raise GateFailure unless `ok`, with a message that names the invariant; `detail` may be a callable (built
    only on failure)."""
    if not ok:
        raise violated(invariant_name, detail() if callable(detail) else detail)


class SteppingMachine(RuleBasedStateMachine):
    """A subclass sets self.pool and self.sched in its @initialize rule and defines begin_step() (schedule and do
    the step's work), finish_step(), check_all(), outstanding_steps() (a bound on the steps that finish everything)
    and check_drained(bound) (nothing hangs, nothing leaks)."""

    def __init__(self):
        super().__init__()
        self.pool = None
        self.busy = False       # a rule is running; if it raised, teardown must not drain over the wreck
        self.in_step = False

    @rule()
    def step(self):
        """schedule() and the step's work; the step stays open (cancels may come) until end_step. If a step is
        open, it ends first."""
        self.busy = True
        if self.in_step:
            self.finish_step()
            self.check_all()
        self.begin_step()
        self.busy = False

    @rule()
    def end_step(self):
        """finish_step(): retire finished and cancelled requests. With no step open, run a whole one."""
        self.busy = True
        if not self.in_step:
            self.begin_step()
            self.check_all()
        self.finish_step()
        self.busy = False

    @rule()
    def drain(self):
        """Keep stepping until every request is done: all complete, nothing leaks."""
        self.busy = True
        self.run_to_completion()
        self.busy = False

    def run_to_completion(self):
        if self.in_step:
            self.finish_step()
            self.check_all()
        bound = self.outstanding_steps()
        for _ in range(bound):
            if not self.sched.has_work:
                break
            self.begin_step()
            self.check_all()
            self.finish_step()
            self.check_all()
        self.check_drained(bound)

    @invariant()
    def invariants(self):
        if self.pool is not None:
            self.busy = True
            self.check_all()
            self.busy = False

    def teardown(self):
        # Drain at the end of every run: everything completes and nothing leaks. Skipped when a rule or an invariant
        # is failing, so that the failure being reported is not masked.
        if self.pool is None or self.busy:
            return
        self.busy = True
        self.run_to_completion()
        self.busy = False
