"""What the scheduler did at each step, for the gates' engine-level checks (gates/schedule_check.py): who was
admitted with which pages, who still waited at the head of the queue, and when released pages reached the free list.
Bookkeeping only: a few integers per event, no tensors."""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter


@dataclass(frozen=True)
class Admission:
    step: int
    request_id: str
    arrival: int                 # arrival index: strict FCFS admits in this order
    prompt_len: int
    budget: int
    pages: tuple[int, ...]       # the pages reserved for it
    hits: int                    # of which found in the prefix cache (shared, not taken from the free pages)
    free_before: int             # free pages just before this admission (at least: a cached hit nobody held is
                                 # counted free until it is pinned)
    rows: int                    # rows held once it was admitted


@dataclass(frozen=True)
class HeadWait:
    """After the step's admissions, the earliest arrival still waiting."""
    step: int
    request_id: str
    arrival: int
    slots: int                   # prompt + budget
    free: int                    # free pages after the step's admissions
    rows: int                    # rows held after the step's admissions


@dataclass(frozen=True)
class Release:
    step: int
    owner: str
    pages: tuple[int, ...]
    free_before: int
    free_after: int              # free pages right after release(): more than before means free-listed mid-step
    in_step: bool


@dataclass(frozen=True)
class StepEnd:
    step: int
    freed: tuple[int, ...]       # pages the pool put back on the free list at the step's end (the runner poisons them)
    kept: tuple[int, ...] = ()   # pages released in the step that stay held by another request or cached
    duration: float | None = None   # the step's seconds the scheduler gave the prefill-share debt (None: none)


@dataclass(frozen=True)
class Scored:
    """A score() (teacher forcing) between steps: the pages it held, given back when it returned."""
    step: int                    # the steps ended before it
    owner: object                # the pool's owner name for it (Engine's SCORE_OWNER)
    pages: tuple[int, ...]


ARRIVAL = attrgetter("arrival_index")


class ScheduleLog:
    """The events of a run, kept whole for a check after it. `keep=False` records nothing (the pool calls still go
    through): a server that runs for days must not grow by every admission, release and step end (about 730 bytes
    a request), so the engine keeps the log only when asked (Engine(..., schedule_log=ScheduleLog()), as the gates
    do)."""

    def __init__(self, keep: bool = True):
        self.keep = keep
        self.admissions: list[Admission] = []
        self.waits: list[HeadWait] = []
        self.releases: list[Release] = []
        self.ends: list[StepEnd] = []
        self.scores: list[Scored] = []
        self._released: list[int] = []       # pages released in the open step

    def admitted(self, step: int, admitted, pool, free_before: int, rows_before: int, waiting) -> None:
        """Record the step's admissions (in the order they were made) and the head still waiting after them."""
        if not self.keep:
            return
        free, rows = free_before, rows_before
        for r in admitted:
            pages = tuple(pool.owned.get(r.request_id, ()))
            hits = getattr(r, "cached_prefix", 0) // pool.page_size
            rows += 1
            self.admissions.append(Admission(step, r.request_id, r.arrival_index, r.prompt_len, r.budget, pages,
                                             hits, free, rows))
            free -= len(pages) - hits
        if waiting:
            head = min(waiting, key=ARRIVAL)     # the whole queue, as found: a planted bug may disorder it
            self.waits.append(HeadWait(step, head.request_id, head.arrival_index, head.slots_needed, pool.num_free,
                                       rows))

    def release(self, step: int, pool, owner: str) -> None:
        """pool.release(owner), noting whether the pages reached the free list at once (they must wait for
        end_step)."""
        if not self.keep:
            pool.release(owner)
            return
        pages, before, in_step = tuple(pool.owned.get(owner, ())), pool.num_free, pool.in_step
        pool.release(owner)
        self.releases.append(Release(step, owner, pages, before, pool.num_free, in_step))
        self._released.extend(pages)

    def scored(self, step: int, owner, pages) -> None:
        """A score() that held `pages` (and gave them back) before step `step`: their last holder, as the pool
        names it."""
        if self.keep:
            self.scores.append(Scored(step, owner, tuple(pages)))

    def end_step(self, step: int, pool, duration: float | None = None) -> list[int]:
        """pool.end_step(), noting the pages it returned and the step's `duration` the debt was given."""
        freed = pool.end_step()
        if not self.keep:
            return freed
        cached = getattr(pool, "cache", None)
        kept = tuple(p for p in self._released if p not in freed and
                     (p in getattr(pool, "refs", ()) or cached is not None and p in cached.by_page))
        self.ends.append(StepEnd(step, tuple(freed), kept, duration))
        self._released = []
        return freed
