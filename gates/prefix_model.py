"""The prefix cache machine's model (gates/prefix_machine.py): the names of the invariants it checks (every failure
message starts with one), the plain-Python record of one accepted request, and the token a request emits next."""
from __future__ import annotations

from dataclasses import dataclass, field

TOTAL = "free + cached + owned = total"
COUNT = "a page's count equals its holders"
REFERENCED = "no referenced page is evicted"
WRITTEN = "no referenced or cached page is written"
EXACT = "a hit holds the request's own prefix"
ONE_PER_HASH = "one page per hash"
LRU = "eviction in LRU order"
RESERVE = "reservations exact"
FCFS = "strict FCFS admission"
PLAN = "step plan"
STATE = "request state"
RETURN = "eviction at the end of the step"
STATS = "the statistics count the lookups and hits"
COMPLETES = "every request completes"

BLOCKS = 3          # distinct page-sized blocks prompts are built from
VOCAB_OUT = 3       # distinct output tokens


def next_token(tokens) -> int:
    """The token a request emits after `tokens`: a function of them, as a greedy model's choice is."""
    return 5000 + hash(tuple(tokens)) % VOCAB_OUT


@dataclass
class Model:
    """The gate's model of one accepted request."""
    rid: str
    prompt: list[int]
    budget: int
    phase: str = "waiting"
    cached: int = 0
    tokens: list[int] = field(default_factory=list)    # prompt + emitted
    table: list[int] = field(default_factory=list)
    registered: int = 0
    holds: bool = False

    @property
    def emitted(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def done(self) -> bool:
        return self.phase in ("finished", "cancelled")
