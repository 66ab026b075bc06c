"""The admission model: a hypothesis state machine over PagePool + Scheduler and its invariants.

No model, no tensors: the machine drives the pool and the scheduler through random submits (some of them too large
for the whole pool), steps, cancellations (between steps and in the middle of one), ends of steps and drains, and keeps
a plain-Python model of what must be true. After every rule it checks (see docs/DESIGN.md, "Admission invariants"):

- free + owned = total: every page but the null page is either free or owned (pool.check() and our own count);
- no page has two owners, and the null page is never handed out;
- reserve on admit: each admitted request owns exactly ceil((prompt + budget) / page_size) pages, the same pages,
  until the end of the step that retires it;
- strict FCFS admission: requests are admitted in arrival order; the head blocks the rest, and is admitted as soon as
  it fits (pages and a row);
- max batch: at most max_batch requests hold rows; no admission beyond the pool's capacity;
- eviction at the end of the step: a finished or cancelled request's pages return to the free list only at the end
  of the step that retires it (the free count never rises between schedule() and finish_step(), release() never
  grows the free list, and finish_step() returns exactly the retired requests' pages, which the runner poisons);
- never fits: a request larger than the whole pool is refused at submit with NeverFitsError, never left to hang;
- the step foreseen is the step scheduled (gates/foresight_check.py): Scheduler.next_step, exact and complete; and
  the pages foreseen freed (engine/foresight.pages_freed_by, on a copy of the scheduler) are the step's own;
- every request completes when steps keep running, and then no page has leaked.

A step is advanced exactly as engine/engine.py's Engine.step does: each prompt chunk adds its length to num_cached
and emits a token when it completes the prompt; each decode token adds one and emits; a request is FINISHED when it
has emitted its whole budget.

`make_machine(pool_cls, scheduler_cls, page_size)` builds the machine for any pool / scheduler classes: the gate
(gates/test_admission.py) runs it over the real ones, tests/test_planted_admission.py over planted bugs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event, strategies as st
from hypothesis.stateful import initialize, rule

from engine.errors import NeverFitsError, PoolInvariantError
from engine.pool import NULL_PAGE, PagePool
from engine.request import Request
from engine.scheduler import Scheduler

from .foresight_check import ForesightWatch
from .schedule_check import (CANCEL, CAPACITY, COMPLETES, EVICTION, FCFS, NEVER_FITS, OWNERS, PLAN, PROVENANCE,
                             RESERVE, ROWS, STATE, TOTAL, ceil_pages)
from .stepping import PHASE_OF, SteppingMachine, check, violated

PAGE_SIZES = (64, 256)


def submit_or_refuse(pool, scheduler, request: Request) -> None:
    """Queue `request` as Engine.submit does: the pool's never-fits rule (PagePool.check_fits, which Engine.validate
    applies), then Scheduler.add."""
    pool.check_fits(request.request_id, request.prompt_len, request.budget)
    scheduler.add(request)


def watched(pool_cls):
    """`pool_cls` with a spy on release(): releasing must never grow the free list (pages wait for end_step); the
    pool names a held page's owner as its holder, and until the step's end the releasing request as the holder of
    its pages nobody else holds (what a failure report says of a page read in that step)."""

    class Watched(pool_cls):
        def release(self, owner):
            before = self.num_free
            pages = list(self.owned.get(owner, []))
            for p in pages:
                who = self.holder(p)
                check(who[1] == "owned", PROVENANCE,
                      lambda: f"page {p} held by {owner!r}: the pool names {who} as its holder")
            super().release(owner)
            after = self.num_free
            check(after <= before, EVICTION,
                  lambda: f"release({owner!r}) put pages straight back on the free list ({before} -> {after} free, "
                          f"in_step={self.in_step}); pages may return only at end_step()")
            held = {p: o for o, pages_of in self.owned.items() for p in pages_of}
            for p in pages:
                who = self.holder(p)
                want = (held[p], "owned") if p in held else (owner, "released")
                check(who == want or (p in held and who[1] == "owned"), PROVENANCE,
                      lambda: f"page {p} released by {owner!r} in this step: the pool names {who} as its holder, "
                              f"not {want}")

    Watched.__name__ = Watched.__qualname__ = f"Watched{pool_cls.__name__}"
    return Watched


@dataclass
class Expected:
    """The gate's model of one accepted request."""
    rid: str
    prompt_len: int
    budget: int
    arrival: int
    pages: int                   # ceil((prompt + budget) / page_size)
    phase: str = "waiting"       # waiting / prefill / decode / finished / cancelled
    cached: int = 0
    emitted: int = 0
    holds: bool = False          # admitted, not yet retired at the end of a step (owns pages and a row)
    page_ids: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.phase in ("finished", "cancelled")

    def emit(self) -> None:
        self.emitted += 1
        self.phase = "finished" if self.emitted == self.budget else "decode"


class AdmissionMachine(SteppingMachine):
    """The machine without its setup and submit rule, whose strategies depend on the page size (make_machine)."""
    ps: int

    # -- the model's arithmetic ----------------------------------------------------------------------------
    def held_pages(self) -> int:
        return sum(self.model[rid].pages for rid in self.running)

    def describe(self, rid: str) -> str:
        m = self.model[rid]
        return f"{rid} (arrival {m.arrival}, prompt {m.prompt_len} + budget {m.budget}, {m.pages} pages)"

    # -- rules ---------------------------------------------------------------------------------------------
    @rule(kind=st.sampled_from(["running", "waiting", "any", "unknown"]), which=st.integers(0, 63))
    def cancel(self, kind, which):
        """Cancel a request (running, waiting, finished, cancelled, refused or unknown), between steps or
        in the middle of one (after its work, before finish_step)."""
        self.busy = True
        pools = {"running": [rid for rid in self.running if not self.model[rid].done], "waiting": self.queue,
                 "any": self.ids, "unknown": ["nobody"]}
        candidates = pools[kind] or self.ids or ["nobody"]
        rid = candidates[which % len(candidates)]
        m = self.model.get(rid)
        if m is None:
            expected = ("unknown", 0)
        elif m.phase == "finished":
            expected = ("already-finished", m.emitted)
        elif m.phase == "cancelled":
            expected = ("already-cancelled", m.emitted)
        else:
            expected = ("cancelled", m.emitted)
        res = self.sched.cancel(rid, self.requests)
        self.foresight.disturb()
        check((res.outcome, res.emitted) == expected, CANCEL,
              lambda: f"cancel({rid}) gave {res.outcome!r} with {res.emitted} emitted, expected {expected}")
        event(f"cancel: {expected[0]} ({m.phase if m else 'unknown'}"
              f"{', mid-step' if self.in_step else ''})")
        if expected[0] == "cancelled":
            if m.phase == "waiting":
                self.queue.remove(rid)
            m.phase = "cancelled"       # a running one keeps its pages and row until the end of the step
        self.busy = False

    # -- the step ------------------------------------------------------------------------------------------
    def begin_step(self):
        i = self.step_index
        free_before = self.pool.num_free
        waiting_before, rows_before = len(self.sched.waiting), len(self.sched.running)
        plan = self.sched.schedule()
        self.in_step = True
        self.foresight.check(plan, waiting_before, rows_before, self.sched.ledger.prefill_share)
        # admission: arrival order, rows, reservation, capacity
        for r in plan.admitted:
            rid = r.request_id
            head = self.queue[0] if self.queue else None
            check(rid == head, FCFS,
                  lambda: f"step {i} admitted {self.describe(rid) if rid in self.model else rid} while "
                          f"{self.describe(head) if head else 'nothing'} waits ahead of it (queue: {self.queue})")
            self.queue.pop(0)
            m = self.model[rid]
            m.phase, m.holds = "prefill", True
            self.running.append(rid)
            check(len(self.running) <= self.max_batch, ROWS,
                  lambda: f"step {i} admitted {rid}: {len(self.running)} requests now hold rows, "
                          f"max_batch is {self.max_batch} ({self.running})")
            owned = list(self.pool.owned.get(rid, []))
            check(len(owned) == m.pages, RESERVE,
                  lambda: f"step {i} admitted {rid} with {len(owned)} pages {owned}; it needs "
                          f"ceil(({m.prompt_len} + {m.budget}) / {self.ps}) = {m.pages} (whole prompt + budget, "
                          f"rounded up to whole pages)")
            m.page_ids = owned
            check(self.held_pages() <= self.cap, CAPACITY,
                  lambda: f"step {i} admitted {rid}: admitted requests need {self.held_pages()} pages, the pool "
                          f"holds {self.cap}")
        check(self.pool.num_free == free_before - sum(self.model[r.request_id].pages for r in plan.admitted),
              TOTAL, lambda: f"step {i}: {free_before} free before schedule(), {self.pool.num_free} after "
                             f"admitting {[r.request_id for r in plan.admitted]}")
        if self.queue:   # the head blocks the rest, but only while it does not fit
            head = self.model[self.queue[0]]
            free = self.cap - self.held_pages()
            event("head blocked by rows" if len(self.running) >= self.max_batch else "head blocked by pages")
            check(len(self.running) >= self.max_batch or head.pages > free, FCFS,
                  lambda: f"step {i} left the head {self.describe(head.rid)} waiting although it fits "
                          f"({free} pages free, {len(self.running)}/{self.max_batch} rows held)")
        self.free_at_schedule = self.pool.num_free
        # the step's work, as the model predicts it
        decodes = [rid for rid in self.running if self.model[rid].phase == "decode"]
        # prompt chunks: whole chunks [k*C, (k+1)*C) of each prompt (never cut), short prompts (at most
        # short_prompt_positions left) first, then long ones, FCFS within each, while they fit in C
        C, short = self.chunk_tokens, getattr(self.sched, "short_prompt_positions", 512)
        prefilling = [rid for rid in self.running if self.model[rid].phase == "prefill"]
        is_short = {rid: self.model[rid].prompt_len - self.model[rid].cached <= short for rid in prefilling}
        chunks, room = [], C
        for rid in [r for r in prefilling if is_short[r]] + [r for r in prefilling if not is_short[r]]:
            m = self.model[rid]
            n = min((m.cached // C + 1) * C, m.prompt_len) - m.cached
            if n <= room:
                chunks.append((rid, m.cached, n))
                room -= n
        got_chunks = [(c.request.request_id, c.start, c.length) for c in plan.chunks]
        got_decodes = [r.request_id for r in plan.decodes]
        check(got_chunks == chunks and got_decodes == decodes, PLAN,
              lambda: f"step {i}: chunks {got_chunks}, decodes {got_decodes}; expected chunks {chunks} "
                      f"(whole chunks at multiples of chunk_tokens={C}, prompts with at most {short} positions "
                      f"left first, FCFS within each), decodes {decodes}")
        self.foresight.foresee(self.sched, plan)      # before the plan's bookkeeping, as Engine.step does
        plan.apply([7] * len(plan.sampled), 0.0)   # book it exactly as Engine.step does
        for rid, _, n in chunks:
            m = self.model[rid]
            m.cached += n
            if m.cached == m.prompt_len:
                m.emit()
        for rid in decodes:
            m = self.model[rid]
            m.cached += 1
            m.emit()

    def finish_step(self):
        i = self.step_index
        retiring = [rid for rid in self.running if self.model[rid].done]
        expected = sorted(p for rid in retiring for p in self.model[rid].page_ids)
        freed = self.sched.finish_step()
        self.foresight.check_freed(i, freed)
        check(sorted(freed) == expected, EVICTION,
              lambda: f"finish_step() of step {i} returned {sorted(freed)} as the pages that just became free "
                      f"(the runner poisons them), but the requests it retired ({retiring}) held {expected}")
        for rid in retiring:
            self.model[rid].holds = False
            self.running.remove(rid)
        self.in_step = False
        self.step_index += 1

    def outstanding_steps(self) -> int:
        """An upper bound on the steps that finish everything: every step with work left takes at least one
        whole prompt chunk or decode token (the first chunk always fits: a chunk is at most chunk_tokens), and
        reserve on admit guarantees that admitted requests can always proceed."""
        n = 0
        for m in self.model.values():
            if not m.done:
                # a decoding request has cached past its prompt: no prompt chunks left (not a negative count,
                # which at chunk_tokens 1 cancelled its decode steps and made the bound 0: a false hang)
                n += -(-max(0, m.prompt_len - m.cached) // self.chunk_tokens) + m.budget - m.emitted + 1
        return n + 2

    def check_drained(self, bound: int):
        unfinished = [self.describe(rid) for rid, m in self.model.items() if not m.done]
        check(not self.sched.has_work and not unfinished, COMPLETES,
              lambda: f"after {bound} more steps (an upper bound) work is left: unfinished {unfinished}, "
                      f"waiting {[r.request_id for r in self.sched.waiting]}, "
                      f"running {[r.request_id for r in self.sched.running]}, {self.pool.num_free} of "
                      f"{self.cap} pages free (a hang)")
        leaked = {o: p for o, p in self.pool.owned.items()}
        check(self.pool.num_free == self.cap and not leaked and not self.pool.pending, COMPLETES,
              lambda: f"every request is done but only {self.pool.num_free} of {self.cap} pages are free: "
                      f"owned {leaked}, pending {self.pool.pending} (a page leak)")

    # -- invariants ----------------------------------------------------------------------------------------
    def check_all(self):
        pool, cap = self.pool, self.cap
        try:
            pool.check()
        except PoolInvariantError as e:
            raise violated(TOTAL + " / " + OWNERS, f"pool.check(): {e}") from None
        free = list(pool.free)
        owned = [p for pages in pool.owned.values() for p in pages]
        pending = [p for _, pages in pool.pending for p in pages]
        check(pool.num_free == len(free), TOTAL,
              lambda: f"num_free {pool.num_free} but {len(free)} on the free list")
        check(len(free) + len(owned) + len(pending) == cap, TOTAL,
              lambda: f"{len(free)} free + {len(owned)} owned + {len(pending)} pending pages, capacity {cap}")
        everything = free + owned + pending
        dupes = sorted({p for p in everything if everything.count(p) > 1})
        check(not dupes, OWNERS, lambda: f"pages {dupes} are held twice (free: {free}, owned: {dict(pool.owned)}, "
                                         f"pending: {pool.pending})")
        check(NULL_PAGE not in everything and all(0 < p < pool.num_pages for p in everything), OWNERS,
              lambda: f"the null page or a page outside the pool is in circulation: {sorted(everything)}")
        check(len(free) == cap - self.held_pages(), TOTAL,
              lambda: f"{len(free)} pages free, but the requests holding pages ({self.running}) need "
                      f"{self.held_pages()} of {cap}")
        check(not pending, EVICTION, lambda: f"pages {pool.pending} are still pending between rules")
        check(sorted(pool.owned) == sorted(self.running), RESERVE,
              lambda: f"pages are owned by {sorted(pool.owned)}, but the requests holding rows are "
                      f"{sorted(self.running)}")
        for rid in self.running:
            m = self.model[rid]
            check(list(pool.owned[rid]) == m.page_ids and len(m.page_ids) == m.pages, RESERVE,
                  lambda: f"{rid} owns {pool.owned[rid]}, it was given {m.page_ids} on admission and needs "
                          f"{m.pages} pages until it finishes")
        check([r.request_id for r in self.sched.running] == self.running, ROWS,
              lambda: f"the scheduler's rows {[r.request_id for r in self.sched.running]}, expected {self.running}")
        check(len(self.sched.running) <= self.max_batch, ROWS,
              lambda: f"{len(self.sched.running)} requests hold rows, max_batch {self.max_batch}")
        check([r.request_id for r in self.sched.waiting] == self.queue, FCFS,
              lambda: f"the waiting queue is {[r.request_id for r in self.sched.waiting]}, arrival order of the "
                      f"requests not yet admitted is {self.queue}")
        if self.in_step:
            check(pool.num_free <= self.free_at_schedule, EVICTION,
                  lambda: f"the free count rose from {self.free_at_schedule} to {pool.num_free} in the middle of "
                          f"step {self.step_index}")
        for rid in list(self.live):
            m, r = self.model[rid], self.requests[rid]
            got = (PHASE_OF[r.state], r.num_cached, len(r.output))
            check(got == (m.phase, m.cached, m.emitted), STATE,
                  lambda: f"{rid}: (state, num_cached, emitted) = {got}, expected "
                          f"{(m.phase, m.cached, m.emitted)}")
            if m.done and not m.holds:
                self.live.discard(rid)      # retired: nothing changes it any more


def make_machine(pool_cls=PagePool, scheduler_cls=Scheduler, page_size: int = 64):
    """The admission state machine over `pool_cls` and `scheduler_cls`, with pages of `page_size` slots."""
    ps = page_size
    pool_under_test = watched(pool_cls)

    class Machine(AdmissionMachine):
        # -- setup ---------------------------------------------------------------------------------------------
        @initialize(num_pages=st.integers(2, 10), max_batch=st.integers(1, 4),
                    chunk_tokens=st.integers(max(1, ps // 8), 2 * ps))
        def setup(self, num_pages, max_batch, chunk_tokens):
            self.busy = True
            self.ps = ps
            self.pool = pool_under_test(num_pages, ps)
            self.sched = scheduler_cls(self.pool, max_batch=max_batch, chunk_tokens=chunk_tokens)
            self.cap = num_pages - 1
            self.max_batch = max_batch
            self.chunk_tokens = chunk_tokens
            self.requests: dict[str, Request] = {}      # what Engine.requests holds: accepted requests
            self.model: dict[str, Expected] = {}
            self.live: set[str] = set()                 # accepted requests not yet done and retired
            self.queue: list[str] = []                  # model: waiting, in arrival order
            self.running: list[str] = []                # model: holding rows, in admission order
            self.ids: list[str] = []                    # every id tried, refused ones too
            self.arrivals = 0
            self.in_step = False
            self.free_at_schedule = 0
            self.foresight = ForesightWatch(max_batch)
            self.step_index = 0
            self.busy = False

        # -- rules ---------------------------------------------------------------------------------------------
        @rule(k=st.one_of(st.integers(1, 3), st.integers(1, 11)),
              offset=st.one_of(st.sampled_from([0, -1, 1]), st.integers(-(ps - 1), 0)),
              budget=st.integers(1, 48))
        def submit(self, k, offset, budget):
            """A request of about k pages (k may exceed the pool), often right at a page boundary."""
            self.busy = True
            total = max(2, k * ps + offset)
            budget = min(budget, total - 1)
            prompt_len = total - budget
            rid = f"r{len(self.ids)}"
            self.ids.append(rid)
            need = ceil_pages(total, ps)
            waiting_before = [r.request_id for r in self.sched.waiting]
            request = Request(rid, [1] * prompt_len, budget)
            self.foresight.disturb()
            try:
                submit_or_refuse(self.pool, self.sched, request)
            except NeverFitsError as e:
                check(need > self.cap, NEVER_FITS,
                      f"{rid} (prompt {prompt_len} + budget {budget} = {need} pages of {ps}) was refused, but the "
                      f"pool holds {self.cap} pages: {e}")
                check([r.request_id for r in self.sched.waiting] == waiting_before, NEVER_FITS,
                      f"refusing {rid} changed the waiting queue")
                event("refused: never fits")
            else:
                check(need <= self.cap, NEVER_FITS,
                      f"{rid} needs ceil(({prompt_len} + {budget}) / {ps}) = {need} pages but the whole pool holds "
                      f"{self.cap}: it was accepted at submit and would wait forever instead of raising "
                      f"NeverFitsError")
                self.requests[rid] = request
                self.model[rid] = Expected(rid, prompt_len, budget, self.arrivals, need)
                # the accepted submits counted one by one (a count that skipped, 0, 2, 4, still orders them: session
                # 18's survivor `next_arrival += 2` passed every ordering check)
                check(request.arrival_index == self.arrivals, FCFS,
                      f"{rid} is accepted submit number {self.arrivals} (from 0): its arrival index is "
                      f"{request.arrival_index}; arrival indices count the accepted submits")
                self.arrivals += 1
                self.queue.append(rid)
                self.live.add(rid)
            self.busy = False

    Machine.__name__ = Machine.__qualname__ = \
        f"Admission_{pool_cls.__name__}_{scheduler_cls.__name__}_page{page_size}"
    return Machine
