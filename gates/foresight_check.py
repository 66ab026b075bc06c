"""The scheduler's foresight, checked (a gate library module, used by the admission machine): Scheduler.next_step
foresees the step after the one in flight so that the engine can launch it before that step is read back.

- Exact: when nothing was submitted or cancelled in between, the step foreseen is the step schedule() then makes:
  the same prompt chunks, the same decode rows at the same positions in the same order, nobody admitted (else the
  engine drops the launch: tokens stay right, the time is lost).
- Complete: next_step says None (nothing launched ahead) only where its docstring allows it: a request waited while
  a row would free for it, the prefill share is under 1 with prompts still filling, or the next step has no work.
  A foresight that gives up more often passes every token gate and quietly serializes the steps.

Compared field by field here, not through the engine's own Foresight matcher (engine/foresight.py), so that a bug
there cannot hide one in next_step.

- The pages foreseen freed are the step's own: engine/foresight.pages_freed_by (which poison mode poisons before the
  step launched ahead reads anything) runs the step's end on a copy of the scheduler; what it returns must be what
  the step's real finish_step frees, and the copy must change nothing real (a copy sharing a list with the pool frees
  the pages twice, or never). Unless a cancel landed during the step (that frees more; the engine drops the launch).
"""
from __future__ import annotations

from engine import foresight

from .stepping import check

FORESIGHT = "the step foreseen is the step scheduled"
FREED = "the pages foreseen freed are the step's own"


def pool_state(pool) -> tuple:
    """What a step's end changes in the pool: its free list, owners, holder counts, pending releases and, with the
    prefix cache, the cached pages and their LRU order."""
    cache = pool.cache
    return (list(pool.free), {o: list(p) for o, p in pool.owned.items()}, dict(pool.refs),
            [(o, list(p)) for o, p in pool.pending], cache and sorted(cache.by_page), cache and list(cache.lru))


def described(chunks, rows) -> tuple[list, list]:
    return ([(c.request.request_id, c.start, c.length) for c in chunks], [(r.request_id, r.num_cached) for r in rows])


class ForesightWatch:
    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self.foreseen = None        # what next_step said about the step after `at`
        self.at: int | None = None
        self.disturbed = True       # a submit or cancel since: next_step promised nothing

    def disturb(self) -> None:
        self.disturbed = True

    def foresee(self, sched, plan) -> None:
        """Right after schedule(), before the plan's bookkeeping, as the engine calls it."""
        self.foreseen, self.at, self.disturbed = sched.next_step(plan), plan.index, False
        pool, before = sched.kv.pool, pool_state(sched.kv.pool)
        self.freed = foresight.pages_freed_by(sched, plan)
        after = pool_state(pool)
        check(after == before, FREED,
              lambda: f"step {plan.index}: pages_freed_by() changed the real pool, not a copy of it: (free list, "
                      f"owners, holders, pending, cached pages, LRU) {before} before, {after} after")

    def check_freed(self, index: int, freed: list[int]) -> None:
        """`freed`: what step `index`'s finish_step() returned."""
        if self.disturbed or self.at != index:
            return
        check(sorted(self.freed) == sorted(freed), FREED,
              lambda: f"step {index}: pages_freed_by() foresaw {sorted(self.freed)} freed at the step's end, its "
                      f"finish_step() freed {sorted(freed)} (nothing submitted or cancelled during the step)")

    def check(self, plan, waiting_before: int, rows_before: int, prefill_share: float) -> None:
        """`plan`: the step just scheduled; waiting_before, rows_before: the queue and the rows held before that
        schedule()."""
        if self.disturbed or self.at is None or self.at != plan.index - 1:
            return
        f, i = self.foreseen, plan.index
        want = described(plan.chunks, [r for r in plan.decodes])
        if f is None:
            allowed = ((waiting_before and rows_before < self.max_batch) or not (plan.chunks or plan.decodes)
                       or (prefill_share < 1.0 and plan.chunks))
            check(allowed, FORESIGHT,
                  lambda: f"step {i - 1}: next_step() foresaw nothing, but step {i} admitted nobody ({waiting_before} "
                          f"waiting, {rows_before}/{self.max_batch} rows held) and carried chunks {want[0]} and decode "
                          f"rows {want[1]}, nothing submitted or cancelled in between: it could have been launched "
                          f"ahead")
            return
        got = described(f.chunks, f.rows)
        check(not plan.admitted and got == want, FORESIGHT,
              lambda: f"step {i - 1}: next_step() foresaw chunks {got[0]} and decode rows (request, position) {got[1]}; "
                      f"step {i} admitted {[r.request_id for r in plan.admitted]} and carried chunks {want[0]}, rows "
                      f"{want[1]}, nothing submitted or cancelled in between")
