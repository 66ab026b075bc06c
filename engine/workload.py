"""Workloads as in the seeds: the mixed draw, the uniform control, Poisson arrivals; scaled variants for the small
model on CPU. Prompts are token ids from a seeded generator, so a workload is named by its parameters and seed."""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace

from .scheduler import CHUNK_TOKENS

SEED = 1234
CPU_CHUNK_TOKENS = CHUNK_TOKENS // 4     # the CPU workloads' chunk budget, scaled as their prompts


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    budget: int
    arrival_time: float = 0.0


@dataclass(frozen=True)
class Workload:
    name: str
    prompt_lengths: tuple[int, ...]      # drawn uniformly per request
    budget_range: tuple[int, int]        # inclusive
    num_requests: int
    seed: int = SEED
    token_range: tuple[int, int] = (3, 4000)   # prompt token ids drawn from [lo, hi)
    chunk_tokens: int = CHUNK_TOKENS     # the chunk budget this workload is served with (scaled on CPU)
    lengths_in_order: bool = False       # request i takes prompt_lengths[i % len] instead of a draw
    budgets: tuple[int, ...] = ()        # when given, request i takes budgets[i % len] instead of a draw

    def requests(self, vocab_size: int | None = None) -> list[RequestSpec]:
        rng, rand = self.draw(vocab_size)
        out = []
        for i in range(self.num_requests):
            n = self.prompt_lengths[i % len(self.prompt_lengths)] if self.lengths_in_order else \
                rng.choice(self.prompt_lengths)
            budget = self.budgets[i % len(self.budgets)] if self.budgets else rng.randint(*self.budget_range)
            out.append(RequestSpec(f"{self.name}-{i:04d}", rand(n), budget))
        return out

    def draw(self, vocab_size: int | None):
        """The seeded generator, and rand(n): n token ids from token_range (cut to the vocabulary)."""
        rng = random.Random(self.seed)
        lo, hi = self.token_range
        if vocab_size is not None:
            hi = min(hi, vocab_size)
        return rng, lambda n: [rng.randrange(lo, hi) for _ in range(n)]

    def describe(self) -> dict:
        return asdict(self)

    def with_budget(self, budget: int) -> "Workload":
        return replace(self, budget_range=(budget, budget))

    def scaled(self, num_requests: int) -> "Workload":
        return replace(self, num_requests=num_requests)


# The seeds' draws, for the 1.5B-shaped model.
MIXED = Workload("mixed", (16, 64, 256, 1024, 4096), (64, 256), 32)
UNIFORM = Workload("uniform", (256,), (64, 256), 256)

# Scaled for the small model on CPU: prompts / 4 (so several prompt chunks at chunk_tokens 128), budgets / 4, and
# more requests than rows (48 requests, 32 rows) so admission is continuous.
MIXED_CPU = Workload("mixed-cpu", (4, 16, 64, 256, 1024), (16, 64), 48, chunk_tokens=CPU_CHUNK_TOKENS)
UNIFORM_CPU = Workload("uniform-cpu", (64,), (16, 64), 48, chunk_tokens=CPU_CHUNK_TOKENS)

# The gate workloads for a large model (the 1.5B shape on GPU): the seeds' prompt lengths, short budgets so that the
# hf reference (one request at a time) stays quick, and more requests than rows.
MIXED_GATE = Workload("mixed-gate", (16, 64, 256, 1024, 4096), (16, 32), 40)
UNIFORM_GATE = Workload("uniform-gate", (256,), (16, 32), 40)


@dataclass(frozen=True)
class SharedPrefixWorkload(Workload):
    """Requests that share prefixes: a system prompt of `system_len` tokens, then a question drawn from
    prompt_lengths; a share of them instead repeat an earlier prompt exactly (`repeat_share`) or are its next turn
    (`followup_share`: the earlier prompt, a reply as long as its budget, a new question)."""
    system_len: int = 1024
    repeat_share: float = 0.2
    followup_share: float = 0.2

    def requests(self, vocab_size: int | None = None) -> list[RequestSpec]:
        rng, rand = self.draw(vocab_size)
        system = rand(self.system_len)
        out = []
        for i in range(self.num_requests):
            budget = rng.randint(*self.budget_range)
            u = rng.random()
            prev = rng.choice(out) if out else None
            if prev and u < self.repeat_share:
                prompt = list(prev.prompt)
            elif prev and u < self.repeat_share + self.followup_share \
                    and len(prev.prompt) + prev.budget < self.system_len + 4 * max(self.prompt_lengths):
                prompt = prev.prompt + rand(prev.budget) + rand(rng.choice(self.prompt_lengths))
            else:
                prompt = system + rand(rng.choice(self.prompt_lengths))
            out.append(RequestSpec(f"{self.name}-{i:04d}", prompt, budget))
        return out


# A long system prompt shared by most requests (the 1.5B shape; CPU: lengths / 4, as the mixed draw's).
SHARED = SharedPrefixWorkload("shared", (16, 64, 256), (64, 256), 200, system_len=1024)
SHARED_CPU = SharedPrefixWorkload("shared-cpu", (4, 16, 64), (16, 64), 48, chunk_tokens=CPU_CHUNK_TOKENS,
                                  system_len=256)

# The smoke gate's requests: one per prompt length, each at a page boundary (64; 256 where flash decodes) or a chunk
# boundary (128 on CPU, 512 otherwise), with short budgets, so that a bug that changes numbers fails in seconds.
SMOKE_CPU = Workload("smoke-cpu", (63, 64, 65, 127, 128, 129, 255, 256, 257), (8, 12), 9, chunk_tokens=CPU_CHUNK_TOKENS,
                     lengths_in_order=True)
SMOKE_GATE = Workload("smoke-gate", (63, 64, 65, 255, 256, 257, 511, 512, 513), (8, 12), 9, lengths_in_order=True)

# The loaded-step gate's requests: short prompts decode at once while long ones are still read in chunks of 64, so
# that most steps carry prompt chunks and decode tokens in one forward. Token ids from the whole small vocabulary.
LOADED_CPU = Workload("loaded-cpu", (3, 9, 700, 5, 450, 300), (8, 40), 6, seed=7, token_range=(3, 4096),
                      chunk_tokens=64, lengths_in_order=True, budgets=(40, 40, 8, 40, 8, 12))
LOADED_GATE = replace(LOADED_CPU, name="loaded-gate")

WORKLOADS = {w.name: w for w in (MIXED, UNIFORM, MIXED_CPU, UNIFORM_CPU, MIXED_GATE, UNIFORM_GATE, SHARED,
                                 SHARED_CPU, SMOKE_CPU, SMOKE_GATE, LOADED_CPU, LOADED_GATE)}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {sorted(WORKLOADS)}") from None


def poisson_arrivals(specs: list[RequestSpec], rate: float, seed: int = SEED) -> list[RequestSpec]:
    """The same requests with Poisson arrival times at `rate` requests/s, from a fixed seed."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for s in specs:
        t += rng.expovariate(rate)
        out.append(RequestSpec(s.request_id, s.prompt, s.budget, t))
    return out
