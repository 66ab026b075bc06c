"""The engine's checks of the step it launched ahead (EngineConfig.overlap), foreseen by Scheduler.next_step: whether
the real schedule is that step (matches), and which pages the step in flight frees at its end (pages_freed_by), so
that poison mode poisons them before the step launched after it reads any. Bookkeeping alone, no torch: both read
only the scheduler and its plans."""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Foresight, Scheduler, StepPlan


def matches(step: Foresight, plan: StepPlan) -> bool:
    """The step launched ahead computed this plan: the same prompt chunks, and the same decode rows at the same
    positions in the same order, nobody admitted."""
    return (not plan.admitted and len(step.chunks) == len(plan.chunks) and len(step.rows) == len(plan.decodes)
            and all(a.request is c.request and a.start == c.start and a.length == c.length
                    for a, c in zip(step.chunks, plan.chunks))
            and all(a.request is r and a.num_cached == r.num_cached for a, r in zip(step.rows, plan.decodes)))


def pages_freed_by(scheduler: Scheduler, plan: StepPlan) -> list[int]:
    """The pages that the end of `plan`'s step will free, before its tokens are known: its bookkeeping run on a
    copy of the scheduler (which retires what finishes by its budget, caches full pages and frees the rest);
    which pages it frees does not depend on the tokens. A cancel during the step frees more; the step launched
    ahead is then dropped (matches), and those pages are poisoned at the step's end as usual.

    The copy leaves out what the bookkeeping only reads or only records: the schedule log (a gate run's log holds
    every event of the run, so copying it each step made the copies grow with the run: 25 ms a step on average at
    94 steps, 37 ms in the GPU gate suite's 690 foresights) becomes one that records nothing, and the requests'
    prompts (never written) are shared, not copied, and so are the waiting requests whole: a step's end reads and
    writes only the running ones (a gate's queue holds up to 30 requests, most of a copy's objects: 0.7 ms a foresight
    on CPU in the admission gate's longest machine, 20,000 foresights a run)."""
    from .schedule_log import ScheduleLog
    memo = {id(scheduler.log): ScheduleLog(keep=False)}
    for r in scheduler.running:
        memo[id(r.prompt)] = r.prompt
    for r in scheduler.waiting:
        memo[id(r)] = r
    scheduler, copied = copy.deepcopy((scheduler, plan), memo)
    copied.apply([0] * len(copied.sampled), 0.0)
    return scheduler.finish_step()
