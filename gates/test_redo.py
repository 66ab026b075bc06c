"""The all-or-nothing step as a gate: a step that an exception interrupts before its commit (while scheduled, once
launched, before its readback) is undone, and the next step() redoes it; the run then serves exactly what an
undisturbed run of the same configuration serves: every token, the step that emitted it, every prompt chunk, every
step of the trace. Run on the mixed workload (more requests than rows: admissions land while others run) through each
engine configuration, in poison mode, reusing the token gate's undisturbed run. A step launched ahead whose pages were poisoned cannot be redone (Engine._undo
fails the engine by design), so where steps launch ahead the interrupt comes before that launch."""
from __future__ import annotations

import pytest

from engine.workload import get_workload

from .failure import GateFailure
from .runs import CANDIDATES, skip_unless_runs, workload_for
from .schedule_check import check_engine


class Interrupt(Exception):
    """Raised by the gate's step hook, as a failing kernel or a lost device call would raise."""


def served(e) -> dict:
    return {rid: (r.tokens, r.token_steps, r.chunks, r.state) for rid, r in e.results().items()}


def steps(e) -> list[tuple]:
    return [(t.index, t.kind, t.prompt_positions, t.decode_tokens, t.chunks, t.admitted) for t in e.trace]


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_an_interrupted_step_is_redone_identically(runs, opts, engine, backend):
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, "mixed-cpu")
    _, undisturbed = runs.candidate(engine, backend, workload)
    n = len(undisturbed.trace)
    # step index -> point: steps that admit while others run (an undo gives their pages and rows back), and one in
    # the middle of the run
    admitting = [t.index for t in undisturbed.trace if t.admitted and t.index > 0]
    at = {n // 2: "read-back" if not undisturbed.overlap else "scheduled", admitting[0]: "launched",
          admitting[-1]: "scheduled"}
    fired: list[tuple[int, str]] = []

    def interrupt(point: str) -> None:
        plan = e.scheduler.plan
        if plan is not None and at.get(plan.index) == point and all(i != plan.index for i, _ in fired):
            fired.append((plan.index, point))
            raise Interrupt(f"interrupted at step {plan.index}, {point}")

    label = f"{engine}[{backend}] with interrupted steps on {workload}"
    e = runs.engine_reference(engine, backend, workload).engine(step_hook=interrupt)
    for s in get_workload(workload).requests():
        e.submit(s.prompt, s.budget, s.request_id)
    for _ in range(100 * n):
        if not e.scheduler.has_work:
            break
        try:
            e.step()
        except Interrupt:
            e.alive()           # undone, not failed: EngineDeadError here fails the gate with its cause
    else:
        raise GateFailure(f"{label}: no end after {100 * n} steps (the undisturbed run took {n})")
    check_engine(e, label)      # strict FCFS, eviction at the end of the step, pages back, provenance
    assert len(fired) == len(at), f"{label}: interrupts fired {fired}, planned {at} (the run was shorter?)"
    got, want = served(e), served(undisturbed)
    wrong = [rid for rid in want if got.get(rid) != want[rid]]
    if wrong or got.keys() != want.keys() or steps(e) != steps(undisturbed):
        rid = (wrong or [None])[0]
        raise GateFailure(
            f"{label}: interrupted at {fired} and redone, the run served something else than the undisturbed one: "
            f"{len(wrong)} requests differ" + (f", first {rid}: tokens, token steps, chunks, state {got.get(rid)} vs "
                                               f"{want[rid]}" if rid else "") +
            f"; steps {len(e.trace)} vs {n}, first differing step "
            f"{next((a for a, b in zip(steps(e), steps(undisturbed)) if a != b), None)}")
