"""The scheduler: strict FCFS admission under reserve on admit, and the choice of each step's work. No tensors.

Each step carries every decode token of the requests that are generating, plus up to `chunk_tokens` prompt
positions in prompt chunks.

Prompt chunks are cut at FIXED boundaries: a request's prompt of L positions is read in pieces
[k*C, min((k+1)*C, L)) with C = chunk_tokens, whatever else shares the step and whatever `prefill_share` is. A step
takes whole pieces while their total fits in chunk_tokens: first the prompts with at most `short_prompt_positions`
(512) positions left ("short", first-come-first-served among them), then the other ("long") prompts, FCFS; a piece
that does not fit in what is left of the budget waits for a later step (it is never cut). So the chunk boundaries
of every request are the same for every p, and only the order of whole steps changes (docs/DESIGN.md, "Prefill
share").

Prefix cache (the pool's, when on): the head of the queue first looks up its prompt's whole pages, at most
(prompt - 1) // page_size of them, so that its last prompt position is always computed; it is admitted when the
pages it did not find fit, and starts with num_cached at the end of what it found. So strict FCFS, the chunk
budget and the prefill share see only the positions actually computed, and a request's first write lands in a page
of its own. At the end of each step, before retired requests release their pages, the pages the step completed are
cached (registered); a page with the same key as one already cached stays private.

Prefill share p (0 < p <= 1; p below 0.01, above 1 or not finite falls back to 1): while runnable requests decode, a
step that carried long-prompt work and took t seconds owes the decoders (t - t_d) (1 - p) / p seconds of pure decode
steps (`debt`) before the next long-prompt piece, where t_d is a running estimate (EWMA) of a pure decode step's
duration. So pure decode time : prompt work's extra time = (1 - p) : p, and decoders keep about (1 - p) of their
token rate while a long prompt fills.
- The debt saturates at max(DEBT_CAP_SECONDS, DEBT_CAP_STEPS * t) (t: the loaded step that just ran), so that even a
  tiny p never starves a long prompt for long: a loaded step of t owes at most 8 t (or 1 s) of decoding, which is
  exact for every p >= 1/9 and, for fast steps, down to p = 0.01.
- While debt > 0 and runnable decoders exist, long-prompt pieces are withheld; short prompts' pieces never wait.
- A prompt's LAST long piece (the one after which at most short_prompt_positions are left) also pays its own debt
  ahead, estimated from the extra time of that prompt's previous long piece, and settles the difference after it
  runs. Why: paid after it, that piece's debt would fall due once the prompt already emits its first token, so
  while a prompt of n long pieces fills the decoders would get only n - 1 of its n debts (docs/prefill-share.md).
  A prompt's first long piece has no estimate: nothing is paid ahead for it. A prompt cancelled before its last long piece ran gives back what was charged ahead for it.
- A pure decode step pays off its duration; a step with decode tokens and short-prompt pieces (no long work) pays
  off the decode part of it (min(t, t_d)). No credit: the debt never goes below 0.
- Debt counts only runnable decoders: a step with no decode tokens (nobody decoding, or every decoder finished or
  cancelled) clears it; a step that carried long work but no decode tokens owes nothing.
- p = 1 owes nothing, ever: the steps are exactly those of the piece picking above, without the feature.
Time is injected: Engine.step passes each step's measured duration to finish_step(duration=...); tests pass
synthetic durations. finish_step() without a duration adds and pays off no debt.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum

from .pool import PagePool
from .prefix_cache import Chain
from .request import Request, State
from .schedule_log import ScheduleLog

CHUNK_TOKENS = 512      # the default chunk budget: prompt positions a step may carry (docs/DESIGN.md)


@dataclass(frozen=True)
class Chunk:
    """Prompt positions [start, start + length) of one request, run in this step."""
    request: Request
    start: int
    length: int
    long: bool = False      # the request had more than short_prompt_positions left when the piece was cut

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
    withheld: int = 0           # long prompts whose next piece was withheld for the decoders' debt

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


DEBT_CAP_SECONDS = 1.0      # the debt saturates at max(DEBT_CAP_SECONDS, DEBT_CAP_STEPS * the loaded step's time)
DEBT_CAP_STEPS = 8
DEBT_EPS = 1e-9             # seconds: a debt at or under this is paid (float dust)
DECODE_EWMA = 0.25          # weight of the newest pure decode step in the running estimate of its duration
MIN_SHARE = 0.01


def normalise_share(p) -> float:
    """prefill_share as used: p in [0.01, 1]; below 0.01, above 1, not finite or not a number: 1 (no debt)."""
    try:
        p = float(p)
    except (TypeError, ValueError):
        return 1.0
    if not math.isfinite(p) or p < MIN_SHARE or p > 1.0:
        return 1.0
    return p


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int = 32, chunk_tokens: int = CHUNK_TOKENS, prefill_share: float = 1.0,
                 short_prompt_positions: int = 512):
        if max_batch < 1 or chunk_tokens < 1:
            raise ValueError(f"max_batch and chunk_tokens must be >= 1, got {max_batch}, {chunk_tokens}")
        if short_prompt_positions < 0:
            raise ValueError(f"short_prompt_positions must be >= 0, got {short_prompt_positions}")
        self.pool = pool
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.prefill_share = normalise_share(prefill_share)
        self.short_prompt_positions = short_prompt_positions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []     # admitted, in admission (= arrival) order
        self.step_index = 0
        self.next_arrival = 0
        self.debt = 0.0                      # seconds of pure decode steps owed to the decoders
        self.decode_estimate: float | None = None   # running estimate of a pure decode step's duration (s)
        self.withheld_steps = 0              # steps that withheld a long-prompt piece for the debt
        self.piece_extra: dict[str, float] = {}   # request id -> extra seconds of its latest long piece
        self.prepaid: dict[str, float] = {}       # request id -> debt charged ahead for its last long piece
        self.plan: StepPlan | None = None    # the open step's plan (schedule() .. finish_step())
        self.chains: dict[str, Chain] = {}   # request id -> its pages' keys (prefix cache on)
        self.log = ScheduleLog()             # admissions and releases, for the gates' engine-level checks

    @classmethod
    def from_config(cls, pool: PagePool, config) -> "Scheduler":
        return cls(pool, config.max_batch, config.chunk_tokens, prefill_share=config.prefill_share,
                   short_prompt_positions=config.short_prompt_positions)

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
            hits = self.prefix_hits(r)
            if not self.pool.can_reserve(r.slots_needed, hits):
                break
            self.waiting.popleft()
            self.admit_one(r, hits)
            admitted.append(r)
        return admitted

    def admit_one(self, r: Request, hits: list[int]) -> None:
        """Reserve on admit; a prompt prefix found cached (`hits`, whole pages) counts as already computed."""
        r.pages = self.pool.reserve(r.request_id, r.slots_needed, hits)
        r.num_cached = r.cached_prefix = len(hits) * self.pool.page_size
        cache = self.pool.cache
        if cache is not None:
            self.chains[r.request_id].registered = len(hits)
            cache.lookups += self.shareable_pages(r)
            cache.hits += len(hits)
        r.state = State.PREFILL
        r.admit_step = self.step_index
        self.running.append(r)

    # -- the prefix cache ------------------------------------------------------------------------------------
    def shareable_pages(self, r: Request) -> int:
        """Whole pages of the prompt a request may find cached: at least its last prompt position is computed, so
        that the step that completes the prompt has logits to sample."""
        return (r.prompt_len - 1) // self.pool.page_size

    def prefix_hits(self, r: Request) -> list[int]:
        cache = self.pool.cache
        if cache is None:
            return []
        chain = self.chains.setdefault(r.request_id, Chain())
        return cache.match(chain, r.prompt, self.pool.page_size, self.shareable_pages(r))

    def register_pages(self, plan: StepPlan) -> None:
        """Cache the pages this step completed (prompt and decode pages alike: each position is computed once and
        never rewritten), in admission order, so that of two equal pages computed in one step the earlier
        request's is kept."""
        cache, ps = self.pool.cache, self.pool.page_size
        stepped = {id(c.request) for c in plan.chunks} | {id(r) for r in plan.decodes}
        for r in self.running:
            chain = self.chains.get(r.request_id)
            full = r.num_cached // ps
            if id(r) not in stepped or chain is None or full <= chain.registered:
                continue
            tokens = r.prompt + r.output          # position p holds tokens[p]
            cache.extend(chain, tokens, ps, full)
            for k in range(chain.registered, full):
                self.pool.register(r.request_id, k, chain.keys[k], cache.hashed_of(chain, tokens, ps, k))
            chain.registered = full

    # -- the step's work -------------------------------------------------------------------------------------
    def is_short(self, r: Request) -> bool:
        """A prompt with at most short_prompt_positions positions left: it never waits, and goes first."""
        return r.prompt_left <= self.short_prompt_positions

    def next_piece(self, r: Request) -> Chunk:
        """The request's next piece: from num_cached to the next multiple of chunk_tokens (or the prompt's end)."""
        start = r.num_cached
        end = min((start // self.chunk_tokens + 1) * self.chunk_tokens, r.prompt_len)
        return Chunk(r, start, end - start, long=not self.is_short(r))

    def pick_chunks(self, withhold_long: bool = False) -> tuple[list[Chunk], list[Request]]:
        """Whole pieces while they fit in chunk_tokens: short prompts first (FCFS), then long ones (FCFS), unless
        `withhold_long`. Returns (chunks, long prompts withheld)."""
        prefilling = [r for r in self.running if r.state is State.PREFILL]
        short = [r for r in prefilling if self.is_short(r)]
        long = [r for r in prefilling if not self.is_short(r)]
        budget = self.chunk_tokens
        chunks = []
        for r in short + ([] if withhold_long else long):
            c = self.next_piece(r)
            if c.length <= budget:
                chunks.append(c)
                budget -= c.length
        return chunks, (long if withhold_long else [])

    @property
    def owes(self) -> bool:
        return self.debt > DEBT_EPS

    def schedule(self) -> StepPlan:
        """Admit, then pick this step's prompt chunks and decode tokens. Opens the step in the pool."""
        self.pool.begin_step()
        free, rows = self.pool.num_free, len(self.running)
        plan = StepPlan(self.step_index, admitted=self.admit())
        self.log.admitted(plan.index, plan.admitted, self.pool, free, rows, self.waiting)
        plan.decodes = [r for r in self.running if r.state is State.DECODE]
        if not plan.decodes:
            self.debt = 0.0                  # debt counts only runnable decoders
        elif self.prefill_share < 1.0:
            self.prepay(self.pick_chunks()[0])
        plan.chunks, withheld = self.pick_chunks(withhold_long=self.owes)
        plan.long_chunks = sum(c.long for c in plan.chunks)
        plan.withheld = len(withheld)
        self.withheld_steps += bool(withheld)
        for c in plan.chunks:
            c.request.chunks.append((c.start, c.length))
            c.request.chunk_steps.append(plan.index)
        self.plan = plan
        return plan

    def account(self, plan: StepPlan, duration: float, ahead: float = 0.0) -> None:
        """The debt rule, after a step of `duration` seconds (see the module docstring). `ahead`: debt already
        charged for the step's last long pieces before they ran."""
        p = self.prefill_share
        t = max(0.0, float(duration))
        if not plan.decodes:
            self.debt = 0.0
            return
        if not plan.chunks:                  # a pure decode step: it pays, and teaches the estimate
            self.decode_estimate = t if self.decode_estimate is None else \
                (1 - DECODE_EWMA) * self.decode_estimate + DECODE_EWMA * t
            self.debt = max(0.0, self.debt - t)
            return
        t_d = self.decode_estimate or 0.0
        if plan.long_chunks:
            if p < 1.0:
                extra = max(0.0, t - t_d)
                longs = [c.request.request_id for c in plan.chunks if c.long]
                for rid in longs:
                    self.piece_extra[rid] = extra / len(longs)
                owed = max(0.0, extra * (1.0 - p) / p - ahead)
                self.debt = min(self.debt + owed, self.debt_cap(t))
        else:                                # decode tokens and short pieces only
            self.debt = max(0.0, self.debt - min(t, t_d))

    @staticmethod
    def debt_cap(t: float) -> float:
        return max(DEBT_CAP_SECONDS, DEBT_CAP_STEPS * t)

    def is_last_long(self, c: Chunk) -> bool:
        """A long piece after which the prompt is short (or read): its request's last long piece."""
        return c.long and c.request.prompt_left - c.length <= self.short_prompt_positions

    def prepay(self, chunks: list[Chunk]) -> None:
        """Charge the debt of a last long piece that would run now, once, before it runs (module docstring).
        `prepaid` holds the charge (0 without an estimate) until the piece runs or its request retires."""
        p, t_d = self.prefill_share, self.decode_estimate or 0.0
        for c in chunks:
            rid = c.request.request_id
            if self.is_last_long(c) and rid not in self.prepaid:
                est = self.piece_extra.get(rid)
                before = self.debt
                if est is not None:
                    self.debt = max(before, min(before + est * (1.0 - p) / p, self.debt_cap(est + t_d)))
                self.prepaid[rid] = self.debt - before

    def finish_step(self, duration: float | None = None) -> list[int]:
        """Retire finished and cancelled requests; their pages return to the free list now, at the step's end.
        `duration`: the step's measured seconds, for the prefill-share debt (None: the debt is left as it is)."""
        plan, self.plan = self.plan, None
        # the last long pieces that ran: what they paid ahead is settled now
        ahead = sum(self.prepaid.pop(c.request.request_id, 0.0) for c in plan.chunks if c.long) if plan else 0.0
        if duration is not None and plan is not None and self.prefill_share < 1.0:
            self.account(plan, duration, ahead)
        if plan is not None and self.pool.cache is not None:
            self.register_pages(plan)        # before the releases below: a finishing request's pages stay cached
        for r in [r for r in self.running if r.done]:
            self.running.remove(r)
            self.chains.pop(r.request_id, None)
            self.piece_extra.pop(r.request_id, None)
            # cancelled before its last long piece ran: the debt charged ahead for it is owed to nobody
            self.debt = max(0.0, self.debt - self.prepaid.pop(r.request_id, 0.0))
            self.log.release(self.step_index, self.pool, r.request_id)
        self.step_index += 1
        return self.log.end_step(self.step_index - 1, self.pool)

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
            self.chains.pop(request_id, None)
        r.state = State.CANCELLED   # a running one is retired (pages released) at the end of the step
        return CancelResult(request_id, "cancelled", len(r.output))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)
