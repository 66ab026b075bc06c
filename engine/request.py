"""Per-request bookkeeping: what a request asked for, where it is, what it emitted. No tensors."""
from __future__ import annotations

from typing import TYPE_CHECKING

import enum
from dataclasses import dataclass, field

from .copying import copy_fields

if TYPE_CHECKING:
    from .prefix_cache import Chain


class State(enum.Enum):
    WAITING = "waiting"      # submitted, not yet admitted (owns no pages)
    PREFILL = "prefill"      # admitted, still reading its prompt in prompt chunks
    DECODE = "decode"        # prompt done, generating one decode token per step
    FINISHED = "finished"    # emitted its whole budget
    CANCELLED = "cancelled"  # stopped by cancel(); keeps what it emitted


# the states as module constants for the per-row checks of every step (emit, done, the scheduler's row filters:
# 512 of each a step at 512 rows): looking a member up on the enum class costs about 0.3 us on Python 3.11
PREFILL, DECODE, FINISHED, CANCELLED = State.PREFILL, State.DECODE, State.FINISHED, State.CANCELLED


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    budget: int                     # generation budget: tokens to emit
    arrival_time: float = 0.0
    arrival_index: int = 0          # submit order; strict FCFS admits in this order
    state: State = State.WAITING
    num_cached: int = 0             # positions whose K/V are in the cache
    cached_prefix: int = 0          # prompt positions found in the prefix cache at admission (never computed)
    output: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)   # step index at which each token was emitted
    admit_time: float | None = None
    admit_step: int | None = None
    finish_time: float | None = None
    chunks: list[tuple[int, int]] = field(default_factory=list)   # (start, length) of each prompt chunk, in order
    chunk_steps: list[int] = field(default_factory=list)   # step index of each prompt chunk
    dropped_step: int | None = None     # the step whose token a cancel during its forward dropped
    pages: list[int] = field(default_factory=list)   # reserved on admit; kept after release, for failure reports
    # its pages' hash chain in the prefix cache (engine/kv_cache.py), from its first lookup until it retires
    chain: "Chain | None" = field(default=None, compare=False, repr=False)

    __deepcopy__ = copy_fields      # engine/copying.py: its token lists copied at C speed

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def prompt_left(self) -> int:
        return max(0, self.prompt_len - self.num_cached)

    @property
    def done(self) -> bool:
        s = self.state
        return s is FINISHED or s is CANCELLED

    @property
    def slots_needed(self) -> int:
        """Reserve on admit: the whole prompt plus the whole budget."""
        return self.prompt_len + self.budget

    def emit(self, token: int, step: int, t: float) -> bool:
        """One emitted token; the request finishes when its budget is spent. A cancelled request emits nothing
        (a cancel can land while the step that computed the token runs): False."""
        if self.state is CANCELLED:
            self.dropped_step = step    # its row ran: a decode row wrote the K/V of its last token's position
            return False
        out = self.output
        out.append(token)
        self.token_times.append(t)
        self.token_steps.append(step)
        if len(out) >= self.budget:
            self.state = FINISHED
            self.finish_time = t
        else:
            self.state = DECODE
        return True

    def step_of(self, pos: int) -> int | None:
        """The step whose forward wrote the K/V of sequence position `pos` (None: not written yet)."""
        for (start, length), step in zip(self.chunks, self.chunk_steps):
            if start <= pos < start + length:
                return step
        j = pos - self.prompt_len + 1           # decode row j feeds output[j - 1] at position prompt_len + j - 1
        if j == len(self.token_steps) and j >= 1 and self.dropped_step is not None:
            return self.dropped_step            # the last decode row ran, its token was dropped (a cancel)
        return self.token_steps[j] if 1 <= j < len(self.token_steps) else None

    @property
    def first_token_time(self) -> float | None:
        return self.token_times[0] if self.token_times else None


@dataclass
class RequestResult:
    request_id: str
    prompt: list[int]
    tokens: list[int]
    state: str
    arrival_time: float
    admit_time: float | None
    first_token_time: float | None
    token_times: list[float]
    token_steps: list[int]
    finish_time: float | None
    chunks: list[tuple[int, int]] = field(default_factory=list)   # the prompt's chunk boundaries: (start, length)
    cached_prefix: int = 0          # prompt positions found in the prefix cache at admission

    @property
    def queue_wait(self) -> float | None:
        return None if self.admit_time is None else self.admit_time - self.arrival_time

    @classmethod
    def of(cls, r: Request) -> "RequestResult":
        return cls(r.request_id, list(r.prompt), list(r.output), r.state.value, r.arrival_time, r.admit_time,
                   r.first_token_time, list(r.token_times), list(r.token_steps), r.finish_time,
                   list(r.chunks), r.cached_prefix)
