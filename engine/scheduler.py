"""The scheduler: strict FCFS admission under reserve on admit, and the choice of each step's work. No tensors.

Each step carries every decode token of the requests that are generating, plus up to `chunk_tokens` prompt
positions taken first-come-first-served across the requests still reading their prompt.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .pool import PagePool
from .request import Request, State


@dataclass(frozen=True)
class Chunk:
    """Prompt positions [start, start + length) of one request, run in this step."""
    request: Request
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.request.prompt_len


@dataclass
class StepPlan:
    index: int
    chunks: list[Chunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def kind(self) -> str:
        if self.chunks and self.decodes:
            return "loaded"
        if self.chunks:
            return "chunk-only"
        if self.decodes:
            return "pure-decode"
        return "idle"

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


class Scheduler:
    def __init__(self, pool: PagePool, max_batch: int = 32, chunk_tokens: int = 512):
        if max_batch < 1 or chunk_tokens < 1:
            raise ValueError(f"max_batch and chunk_tokens must be >= 1, got {max_batch}, {chunk_tokens}")
        self.pool = pool
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []     # admitted, in admission (= arrival) order
        self.step_index = 0
        self.next_arrival = 0

    # -- admission -------------------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.arrival_index = self.next_arrival
        self.next_arrival += 1
        self.waiting.append(request)

    def admit(self) -> list[Request]:
        """Strict FCFS: admit from the head while it fits the pool and a row is free; the head blocks the rest."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch \
                and self.pool.can_reserve(self.waiting[0].slots_needed):
            r = self.waiting.popleft()
            self.pool.reserve(r.request_id, r.slots_needed)
            r.state = State.PREFILL
            r.admit_step = self.step_index
            self.running.append(r)
            admitted.append(r)
        return admitted

    # -- the step's work -------------------------------------------------------------------------------------
    def pick_chunks(self) -> list[Chunk]:
        budget = self.chunk_tokens
        chunks = []
        for r in self.running:
            if budget == 0:
                break
            if r.state is State.PREFILL:
                n = min(r.prompt_left, budget)
                chunks.append(Chunk(r, r.num_cached, n))
                budget -= n
        return chunks

    def schedule(self) -> StepPlan:
        """Admit, then pick this step's prompt chunks and decode tokens. Opens the step in the pool."""
        self.pool.begin_step()
        plan = StepPlan(self.step_index, admitted=self.admit())
        plan.decodes = [r for r in self.running if r.state is State.DECODE]
        plan.chunks = self.pick_chunks()
        return plan

    def finish_step(self) -> list[int]:
        """Retire finished and cancelled requests; their pages return to the free list now, at the step's end."""
        for r in [r for r in self.running if r.done]:
            self.running.remove(r)
            self.pool.release(r.request_id)
        self.step_index += 1
        return self.pool.end_step()

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
        r.state = State.CANCELLED   # a running one is retired (pages released) at the end of the step
        return CancelResult(request_id, "cancelled", len(r.output))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.running)
