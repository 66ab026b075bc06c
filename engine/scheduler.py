"""The scheduler: strict FCFS admission under reserve on admit, and the choice of each step's work. No tensors.

Each step carries every decode token of the requests that are generating, plus up to `chunk_tokens` prompt
positions in prompt chunks.

Prompt chunks are cut at FIXED boundaries: a request's prompt of L positions is read in chunks
[k*C, min((k+1)*C, L)) with C = chunk_tokens, whatever else shares the step and whatever `prefill_share` is. A step
takes whole chunks while their total fits in chunk_tokens: first the prompts with at most `short_prompt_positions`
(512) positions left ("short", first-come-first-served among them), then the other ("long") prompts, FCFS; a chunk
that does not fit in what is left of the chunk budget waits for a later step (it is never cut). So the chunk boundaries
of every request are the same for every p, and only the order of whole steps changes (docs/DESIGN.md, "Prefill
share").

Prefix cache (the pool's, when on): the head of the queue first looks up its prompt's whole pages, at most
(prompt - 1) // page_size of them, so that its last prompt position is always computed; it is admitted when the
pages it did not find fit, and starts with num_cached at the end of what it found. So strict FCFS, the chunk
budget and the prefill share see only the positions actually computed, and a request's first write lands in a page
of its own. At the end of each step, before retired requests release their pages, the pages the step completed are
cached (registered); a page with the same key as one already cached stays private.

Prefill share: while requests decode, long prompts' chunks may wait for the decoders' debt (engine/prefill_share.py).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from .copying import copy_fields
from .errors import PoolInvariantError
from .kv_cache import KVCacheManager
from .pool import PagePool
from .prefill_share import DebtLedger
from .request import CANCELLED, DECODE, PREFILL, Request, State
from .schedule_log import ScheduleLog

CHUNK_TOKENS = 512      # the default chunk budget: prompt positions a step may carry (docs/DESIGN.md)


@dataclass(frozen=True)
class Chunk:
    """Prompt positions [start, start + length) of one request, run in this step."""
    request: Request
    start: int
    length: int
    long: bool = False      # the request had more than short_prompt_positions left when the chunk was cut

    __deepcopy__ = copy_fields      # engine/copying.py: the foresight's copy (engine/foresight.py)

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.request.prompt_len


class StepKind(StrEnum):
    """What a step carries. A str, so traces, JSON and tables read (and compare equal to) the plain names."""
    PURE_DECODE = "pure-decode"     # decode tokens only
    LOADED = "loaded"               # prompt chunks and decode tokens
    CHUNK_ONLY = "chunk-only"       # prompt chunks only
    IDLE = "idle"                   # nothing


WORK_KINDS = (StepKind.PURE_DECODE, StepKind.LOADED, StepKind.CHUNK_ONLY)   # the kinds that do work, table order


@dataclass
class StepPlan:
    index: int
    chunks: list[Chunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    long_chunks: int = 0        # chunks of long prompts (more than short_prompt_positions left when picked)
    withheld: int = 0           # long prompts whose next chunk was withheld for the decoders' debt

    __deepcopy__ = copy_fields

    @property
    def sampled(self) -> list[Request]:
        """Requests that get a token this step, in the runner's row order: completing chunks, then decodes."""
        return [c.request for c in self.chunks if c.completes_prompt] + self.decodes

    def apply(self, tokens: list[int], t: float) -> list[Request]:
        """Book the step's work: cached positions advance, each sampled request emits its token (one cancelled
        while the step ran does not). Returns the requests that emitted."""
        for c in self.chunks:
            c.request.num_cached += c.length
        for r in self.decodes:
            r.num_cached += 1
        return [r for r, tok in zip(self.sampled, tokens) if r.emit(tok, self.index, t)]

    @property
    def kind(self) -> StepKind:
        if self.chunks and self.decodes:
            return StepKind.LOADED
        if self.chunks:
            return StepKind.CHUNK_ONLY
        if self.decodes:
            return StepKind.PURE_DECODE
        return StepKind.IDLE

    @property
    def prompt_positions(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decodes


@dataclass(slots=True)     # not frozen: a frozen instance costs 2.3 us to make, this 1 (512 a step at 512 rows)
class NextRow:
    """A decode row of the step after the one in flight, foreseen before that step's tokens are read back
    (Scheduler.next_step): the position it will be at, and where its input token is: row `source` of the step in
    flight's sampled rows, still on the device. It stands in for the request where the runner packs a step (request_id,
    num_cached, output[-1]); its `output` is that source index, which the runner swaps for the device's token. Those
    two are plain attributes, not properties: packing reads them for every row."""
    request: Request
    num_cached: int
    source: int
    request_id: str = field(init=False, repr=False, compare=False)
    output: tuple[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.request_id = self.request.request_id
        self.output = (self.source,)


@dataclass(frozen=True)
class Foresight:
    """The step after the one in flight, as Scheduler.next_step foresees it: its prompt chunks and decode rows."""
    chunks: list[Chunk]
    rows: list[NextRow]


@dataclass(frozen=True)
class ScheduleMark:
    """Scheduler.mark(): what schedule() changes that its plan does not record, as it was before."""
    in_step: bool
    debt: float
    prepaid: dict[str, float]
    withheld_steps: int
    admissions: int           # lengths of the schedule log's lists
    waits: int
    lru: list[int] | None     # the prefix cache's evictable pages in LRU order (None: nothing can be admitted)


@dataclass(frozen=True)
class CancelResult:
    request_id: str
    outcome: str          # "cancelled", "unknown", "already-finished", "already-cancelled"
    emitted: int = 0

    @property
    def cancelled(self) -> bool:
        return self.outcome == "cancelled"

    @property
    def noop(self) -> bool:
        """Nothing happened: the id is unknown, or the request had already finished or been cancelled."""
        return not self.cancelled


class Scheduler:
    """Strict FCFS admission, the choice of each step's prompt chunks and decode tokens, the end of the step. It holds
    the prefill-share debt ledger (`ledger`, of class `ledger_cls`)."""

    ledger_cls = DebtLedger
    __deepcopy__ = copy_fields      # engine/copying.py: the foresight copies a scheduler every step launched ahead

    def __init__(self, pool: PagePool, max_batch: int = 32, chunk_tokens: int = CHUNK_TOKENS,
                 prefill_share: float = 1.0, short_prompt_positions: int = 512, log: ScheduleLog | None = None):
        if max_batch < 1 or chunk_tokens < 1:
            raise ValueError(f"max_batch and chunk_tokens must be >= 1, got {max_batch}, {chunk_tokens}")
        if short_prompt_positions < 0:
            raise ValueError(f"short_prompt_positions must be >= 0, got {short_prompt_positions}")
        self.kv = KVCacheManager(pool)       # the one seam to the pages (reserve, prefix hits, releases)
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.short_prompt_positions = short_prompt_positions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []     # admitted, in admission (= arrival) order
        self.step_index = 0
        self.next_arrival = 0
        self.ledger = self.ledger_cls(prefill_share, short_prompt_positions)
        self.withheld_steps = 0              # steps that withheld a long prompt's chunk for the debt
        self.plan: StepPlan | None = None    # the open step's plan (schedule() .. finish_step())
        # admissions and releases, for the gates' engine-level checks; None: one that keeps nothing (bounded memory)
        self.log = log if log is not None else ScheduleLog(keep=False)

    @classmethod
    def from_config(cls, pool: PagePool, config, log: ScheduleLog | None = None) -> "Scheduler":
        return cls(pool, config.max_batch, config.chunk_tokens, prefill_share=config.prefill_share,
                   short_prompt_positions=config.short_prompt_positions, log=log)

    # -- admission -------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival_index = self.next_arrival
        self.next_arrival += 1
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Strict FCFS: admit from the head while it fits the pool and a row is free; the head blocks the rest.
        With the prefix cache, the head needs only the pages it does not find cached."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            r = self.waiting[0]
            hits = self.kv.hits(r)
            if not self.kv.can_admit(r, hits):
                break
            self.waiting.popleft()
            self.admit_one(r, hits)
            admitted.append(r)
        return admitted

    def admit_one(self, r: Request, hits: list[int]) -> None:
        """Reserve on admit; a prompt prefix found cached (`hits`, whole pages) counts as already computed."""
        self.kv.admit(r, hits)
        r.state = State.PREFILL
        r.admit_step = self.step_index
        self.running.append(r)

    # -- the step's work -------------------------------------------------------------------------------------
    # The chunk helpers take the positions a prompt has cached (`at`): its num_cached for this step, or what this step
    # leaves cached when the step after it is foreseen (next_step).
    def is_short(self, r: Request, at: int) -> bool:
        """A prompt with at most short_prompt_positions positions left: it never waits, and goes first."""
        return r.prompt_len - at <= self.short_prompt_positions

    def chunk_length(self, r: Request, at: int) -> int:
        """Positions in the request's next chunk: from `at` to the next multiple of chunk_tokens (or the prompt's
        end)."""
        return min((at // self.chunk_tokens + 1) * self.chunk_tokens, r.prompt_len) - at

    def next_chunk(self, r: Request, at: int) -> Chunk:
        """The request's next chunk."""
        return Chunk(r, at, self.chunk_length(r, at), long=not self.is_short(r, at))

    def pick_chunks(self, withhold_long: bool = False,
                    prefilling: list[tuple[Request, int]] | None = None) -> tuple[list[Chunk], list[Request]]:
        """Whole chunks while they fit in chunk_tokens: short prompts first (FCFS), then long ones (FCFS), unless
        `withhold_long`. Returns (chunks, long prompts withheld). `prefilling`: the prompts still filling, in running
        order, with their cached positions (None: the running requests in PREFILL, at their num_cached)."""
        if prefilling is None:
            prefilling = [(r, r.num_cached) for r in self.running if r.state is PREFILL]
        short, long = [], []
        for r, at in prefilling:
            (short if self.is_short(r, at) else long).append((r, at))
        room = self.chunk_tokens             # what is left of the chunk budget
        chunks = []
        for r, at in short + ([] if withhold_long else long):
            n = self.chunk_length(r, at)
            if n <= room:                    # a Chunk only for what is taken: most prompts wait at many rows
                chunks.append(self.next_chunk(r, at))
                room -= n
        return chunks, ([r for r, _ in long] if withhold_long else [])

    def schedule(self) -> StepPlan:
        """Admit, then pick this step's prompt chunks and decode tokens. Opens the step in the pool."""
        self.kv.begin_step()
        free, rows = self.kv.num_free, len(self.running)
        plan = StepPlan(self.step_index, admitted=self.admit())
        self.log.admitted(plan.index, plan.admitted, self.kv.pool, free, rows, self.waiting)
        plan.decodes = [r for r in self.running if r.state is DECODE]
        if not plan.decodes:
            self.ledger.debt = 0.0           # debt counts only runnable decoders
        elif self.ledger.prefill_share < 1.0:
            self.ledger.prepay(self.pick_chunks()[0])
        plan.chunks, withheld = self.pick_chunks(withhold_long=self.ledger.owes)
        plan.long_chunks = sum(c.long for c in plan.chunks)
        plan.withheld = len(withheld)
        self.withheld_steps += bool(withheld)
        for c in plan.chunks:
            c.request.chunks.append((c.start, c.length))
            c.request.chunk_steps.append(plan.index)
        self.plan = plan
        return plan

    def mark(self) -> "ScheduleMark":
        """What schedule() is about to change beyond what its plan records: taken before it, for undo(). Cheap: the
        prefix cache's evictable pages are copied only when the step may admit."""
        return ScheduleMark(self.kv.pool.in_step, self.ledger.debt, dict(self.ledger.prepaid), self.withheld_steps,
                            len(self.log.admissions), len(self.log.waits),
                            self.kv.lru() if self.row_free_for_head() else None)

    def row_free_for_head(self) -> bool:
        """A request waits and a row is free: before schedule(), it may admit; after it, the head waits for pages (the
        step's `admission_blocked`)."""
        return bool(self.waiting) and len(self.running) < self.max_batch

    def undo(self, plan: StepPlan, mark: "ScheduleMark", evicted: list[int]) -> None:
        """Undo schedule() for a step that failed before its end: the bookkeeping is as before it (Engine.step redoes
        the step), but for the cached pages it evicted (`evicted`), which come back free. A request admitted by it
        and cancelled since goes nowhere: it holds no pages, never ran, and is done."""
        for c in plan.chunks:
            c.request.chunks.pop()
            c.request.chunk_steps.pop()
        admitted = plan.admitted
        if admitted:
            if any(a is not b for a, b in zip(self.running[-len(admitted):], admitted)):   # not !=: by value
                raise PoolInvariantError(f"step {plan.index}: its admissions are not the last running requests")
            del self.running[-len(admitted):]
        self.kv.unadmit(admitted, evicted, mark.lru)
        for r in reversed(admitted):
            r.num_cached, r.admit_step = 0, None
            if r.state is CANCELLED:
                self.kv.forget(r)
            else:
                r.state = State.WAITING
                self.waiting.appendleft(r)
        self.ledger.debt, self.ledger.prepaid, self.withheld_steps = mark.debt, mark.prepaid, mark.withheld_steps
        del self.log.admissions[mark.admissions:], self.log.waits[mark.waits:]
        self.kv.pool.in_step = mark.in_step
        self.plan = None

    def finish_step(self, duration: float | None = None) -> list[int]:
        """Retire finished and cancelled requests; their pages return to the free list now, at the step's end.
        `duration`: the step's measured seconds, for the prefill-share debt (None: the debt is left as it is)."""
        plan, self.plan = self.plan, None
        self.ledger.settle(plan, duration)
        if plan is not None:
            self.kv.register(plan, self.running)   # before the releases below: a finishing request's pages stay cached
        retired = [r for r in self.running if r.done]
        if retired:     # not list.remove: a Request compares by value, field by field
            self.running[:] = [r for r in self.running if not r.done]
        for r in retired:
            self.kv.forget(r)
            self.ledger.forget(r.request_id)
            self.log.release(self.step_index, self.kv.pool, r.request_id)
        self.step_index += 1
        return self.log.end_step(self.step_index - 1, self.kv.pool, duration)

    def next_step(self, plan: StepPlan) -> "Foresight | None":
        """The step after `plan`, read before `plan`'s tokens are known (its bookkeeping not yet done), when it is
        sure to be what schedule() will make of it, provided nothing is submitted or cancelled before then; None
        otherwise. Sure, because:
        - a request finishes by its budget alone (docs/DESIGN.md: greedy serving ignores EOS), so which rows retire
          and which prompts complete does not depend on the tokens;
        - nothing can be admitted: the queue is empty, or no row frees for its head;
        - the prompt chunks follow from the positions `plan` caches (pick_chunks), unless the prefill-share debt,
          which `plan`'s measured duration feeds, may withhold some (prefill_share < 1 with prompts still filling).
        Its decode rows are `plan`'s sampled rows less those that finish or are cancelled; its chunks, the next of
        the prompts still filling. Changes nothing. The engine launches that step early and checks the real
        schedule against it (Engine.step)."""
        if not plan.chunks and len(plan.decodes) == len(self.running):
            # the usual case, as one comprehension (512 rows a step): a pure decode step over every running request,
            # so the running requests are its decode rows, in order; a cancel since then took a row out of DECODE
            rows = [NextRow(r, r.num_cached + 1, i) for i, r in enumerate(plan.decodes)
                    if r.state is DECODE and len(r.output) + 1 < r.budget]
            if not rows or (self.waiting and len(rows) < self.max_batch):
                return None
            return Foresight([], rows)
        src = {id(r): i for i, r in enumerate(plan.sampled)}
        cut = {id(c.request): c.start + c.length for c in plan.chunks}
        rows, prefilling = [], []
        for r in self.running:
            s = r.state
            if s is CANCELLED:
                continue                                 # retired at the end of `plan`
            i = src.get(id(r))
            if i is None:                                # a prompt still filling after `plan`
                prefilling.append((r, cut.get(id(r), r.num_cached)))
            elif len(r.output) + 1 < r.budget:           # else `plan`'s token is its last
                rows.append(NextRow(r, r.num_cached + 1 if s is DECODE else r.prompt_len, i))
        if self.waiting and len(rows) + len(prefilling) < self.max_batch:
            return None                                  # a row frees for the queue's head: it may be admitted
        chunks = []
        if prefilling:
            if self.ledger.prefill_share < 1.0:
                return None                              # the debt may withhold a long prompt's chunk
            chunks = self.pick_chunks(prefilling=prefilling)[0]
        if not rows and not chunks:
            return None
        return Foresight(chunks, rows)

    # -- cancellation ----------------------------------------------------------------------------------------
    def cancel(self, request_id: str, requests: dict[str, Request]) -> CancelResult:
        r = requests.get(request_id)
        if r is None:
            return CancelResult(request_id, "unknown")
        if r.state is State.FINISHED:
            return CancelResult(request_id, "already-finished", len(r.output))
        if r.state is State.CANCELLED:
            return CancelResult(request_id, "already-cancelled", len(r.output))
        if r.state is State.WAITING:
            self.waiting.remove(r)
            self.kv.forget(r)
        r.state = State.CANCELLED   # a running one is retired (pages released) at the end of the step
        return CancelResult(request_id, "cancelled", len(r.output))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)
