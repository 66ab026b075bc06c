"""The prefix cache's model gates, as a library: the shared-prefix gate workload, a driver that submits each next turn
of a chat when its previous turn has finished (its prompt carries the previous turn's reply), and a watch that checks
every page evicted for an admission before the step's forward.

The workload, for pages of P slots (served with more requests than rows, in a pool that evicts cached pages):
- a system prompt of 2P + 5 tokens shared by many requests, each with its own question;
- identical prompts of 2P - 1, 2P and 2P + 1 tokens (the last prompt position is always computed: 1, 1, 2 pages hit);
- prompts that share a prefix ending one short of, exactly at and one past a page boundary (2P - 1, 2P, 2P + 1);
- a page with the same ids after two different first pages (only a hash without its prefix would share it);
- chats of three turns: each next turn is the previous prompt + its reply + a new question, so it finds pages that
  the previous turn's decode tokens filled.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from engine.pool import PagePool
from engine.prefix_cache import short

from .compare import compare
from .failure import GateFailure
from .reference import EngineReference, records_of

# Served with more requests than rows (4), the CPU workloads' chunk budget, and a pool of 21 pages whatever their size
# (the workload's lengths scale with it): cached pages get evicted while others are still reused.
MAX_BATCH = 4
CHUNK_TOKENS = 128
POOL_PAGES = 22


@dataclass(frozen=True)
class Turn:
    request_id: str
    tokens: tuple[int, ...]       # a first turn's whole prompt; a next turn's new question
    budget: int
    after: str | None = None      # the previous turn: prompt = its prompt + its reply + tokens


def shared_prefix_turns(vocab: int, page_size: int, seed: int = 19) -> list[Turn]:
    P, rng = page_size, random.Random(seed)

    def rand(n):
        return tuple(rng.randrange(3, vocab) for _ in range(n))

    system = rand(2 * P + 5)
    asks = [system + rand(n) for n in (1, 20, P - 1, P, P + 1, 7, 3, 40)]
    same = [rand(n) for n in (2 * P - 1, 2 * P, 2 * P + 1)]
    base = rand(3 * P)
    cut = [base[:n] + rand(9) for n in (2 * P - 1, 2 * P, 2 * P + 1)]
    x0, y0, c = rand(P), rand(P), rand(P)
    bait = [x0 + c + rand(5), y0 + rand(5), y0 + c + rand(5)]
    first = [("sys", asks[:2]), ("same", same), ("base", [base + rand(3)]), ("bait", bait[:2]),
             ("sys", asks[2:5]), ("same", same), ("cut", cut), ("bait", bait[2:]), ("sys", asks[5:])]
    turns, n = [], 0
    for tag, prompts in first:
        for p in prompts:
            turns.append(Turn(f"{tag}-{n:02d}", p, 4 + n % 3))
            n += 1
    for k in range(3):
        t1 = Turn(f"chat{k}-t1", rand(P - 6), 8)
        t2 = Turn(f"chat{k}-t2", rand(P // 2 + 20), 16, after=t1.request_id)
        t3 = Turn(f"chat{k}-t3", rand(10), 4, after=t2.request_id)
        turns += [t1, t2, t3]       # last: a next turn then waits behind few others and finds its reply cached
    return turns


def serve_turns(engine, turns: list[Turn], prompts: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Serve `turns` on `engine`: first turns at once in list order, each next turn as soon as its previous turn has
    finished. A next turn's prompt is the previous prompt + the engine's reply + its own tokens, or `prompts[id]` (a
    reference run's prompts, so that two runs serve the same prompts). Returns the prompts served."""
    served: dict[str, list[int]] = {}

    def submit(t: Turn):
        if prompts is not None:
            p = prompts[t.request_id]
        elif t.after is None:
            p = list(t.tokens)
        else:
            prev = engine.requests[t.after]
            p = list(prev.prompt) + list(prev.output) + list(t.tokens)
        served[t.request_id] = p
        engine.submit(p, t.budget, t.request_id)

    for t in turns:
        if t.after is None:
            submit(t)
    todo = [t for t in turns if t.after is not None]
    for _ in range(100000):
        if not engine.scheduler.has_work and not todo:
            return served
        engine.step()
        ready = [t for t in todo if t.after in engine.requests and engine.requests[t.after].done]
        for t in ready:
            submit(t)
        todo = [t for t in todo if t not in ready]
    raise GateFailure(f"serving the turns did not finish: {len(todo)} next turns never submitted (a hang)")


class EvictionWatch:
    """Wraps an engine: every page evicted to admit a step's requests must, before that step's forward, be NaN in
    every layer (poison mode) and be held by exactly one request, one admitted in this step, as a page of its own
    (not a hit); and the pool's invariants must hold after every admission. Fails at the first breach."""

    def __init__(self, engine):
        self.engine = engine
        self.pending: list[int] = []
        self.checked = 0
        self.hits: dict[str, list[tuple[int, str]]] = {}    # request -> (page, hash) of each page it found cached
        pool, runner = engine.pool, engine.runner
        take, launch = pool.take_evicted, runner.launch

        def take_evicted():
            pages = take()
            self.pending += pages
            return pages

        def watched_launch(plan, *args, **kwargs):
            self.check(plan)
            return launch(plan, *args, **kwargs)

        pool.take_evicted = take_evicted
        runner.launch = watched_launch     # every step (poison mode: none is launched ahead)

    def check(self, plan) -> None:
        pool, runner = self.engine.pool, self.engine.runner
        holders = pool.holders()
        admitted = {r.request_id: r for r in plan.admitted}
        for r in plan.admitted:
            found = pool.owned[r.request_id][:r.cached_prefix // pool.page_size]
            self.hits[r.request_id] = [(p, short(pool.cache.key_of(p))) for p in found]
        for page in self.pending:
            key = short(pool.cache.evicted_keys.get(page))
            who = holders.get(page, [])
            if not (len(who) == 1 and who[0] in admitted):
                raise GateFailure(
                    f"step {plan.index}: page {page} (hash {key} when evicted) is held by {who or 'nobody'}; only "
                    f"the request admitted for it (one of {sorted(admitted)}) may hold an evicted page")
            r = admitted[who[0]]
            k = pool.owned[r.request_id].index(page)
            if k < r.cached_prefix // pool.page_size:
                raise GateFailure(
                    f"step {plan.index}: page {page} (hash {key} when evicted) is {r.request_id}'s page {k}, one it "
                    f"found cached: an evicted page was handed out as a hit")
            for layer, (kc, vc) in enumerate(runner.kv_caches):
                finite = int(torch.isfinite(kc[page]).sum() + torch.isfinite(vc[page]).sum())
                if finite:
                    raise GateFailure(
                        f"step {plan.index}: page {page} (hash {key} when evicted, now {r.request_id}'s page {k}) "
                        f"has {finite} finite K/V values in layer {layer} before its new owner's first write: an "
                        f"evicted page must be NaN before reuse")
            self.checked += 1
        self.pending = []
        pool.check()


def serve_pair(loaded, engine: str, backend: str, device: str, dtype: str, pool_cls=PagePool):
    """The shared-prefix workload with the prefix cache off (the reference), then on (with `pool_cls`, watched), in
    poison mode. Returns (off engine, on engine, watch, turns)."""
    def make(on: bool, **parts):
        return EngineReference(engine, device=device, dtype=dtype, loaded=loaded, backend=backend, poison=True,
                               prefix_cache=on, max_batch=MAX_BATCH, chunk_tokens=CHUNK_TOKENS,
                               num_pages=POOL_PAGES).engine(**parts)
    off = make(False)
    turns = shared_prefix_turns(loaded[0].shape.vocab_size, off.config.page_size)
    prompts = serve_turns(off, turns)
    on = make(True, pool_cls=pool_cls)      # a planted pool comes in here (tests/test_planted_prefix.py)
    watch = EvictionWatch(on)
    serve_turns(on, turns, prompts)
    return off, on, watch, turns


def hit_problems(e, hits: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Each request found at most what it shares with the tokens of requests admitted before it (whole pages, at
    most prompt - 1 positions): a longer hit is a false one, whatever the hash says."""
    P, out, before = e.pool.page_size, [], []
    for r in sorted(e.requests.values(), key=lambda r: (r.admit_step, r.arrival_index)):
        common = 0
        for seq in before:
            n = next((i for i, (a, b) in enumerate(zip(seq, r.prompt)) if a != b), min(len(seq), len(r.prompt)))
            common = max(common, n)
        bound = min(common, r.prompt_len - 1) // P * P
        if r.cached_prefix > bound:
            out.append(f"{r.request_id} started at position {r.cached_prefix} (found cached) but shares only "
                       f"{common} positions with the requests admitted before it: whole pages up to {bound} at most "
                       f"(a false hit: it found pages (page, hash) {hits.get(r.request_id)})")
        before.append(list(r.prompt) + list(r.output))
    return out


def stats_problems(cache, requests, page_size: int) -> list[str]:
    """The prefix cache's statistics against the requests: a lookup counts each admitted request's whole prompt pages
    but the last position's ((prompt - 1) // page_size), a hit each page it found cached (cached_prefix / page), the
    hit rate is their quotient (0 before any lookup), and the cached pages are the cache's."""
    admitted = [r for r in requests if r.admit_step is not None]
    want = dict(prefix_lookup_pages=sum((r.prompt_len - 1) // page_size for r in admitted),
                prefix_hit_pages=sum(r.cached_prefix // page_size for r in admitted))
    lookups = want["prefix_lookup_pages"]
    want["prefix_hit_rate"] = want["prefix_hit_pages"] / lookups if lookups else 0.0
    want["prefix_cached_pages"] = len(cache.by_page)
    got = cache.stats()
    wrong = {k: (got[k], v) for k, v in want.items() if got[k] != v}
    return [f"prefix cache statistics (got, expected from the {len(admitted)} admitted requests): {wrong}"] if wrong \
        else []


def pair_problems(off, on, watch, turns: list[Turn], score, threshold: float, flip_cap: int) -> tuple[list[str], object]:
    """Cache on against off: tokens under the 0.02 rule, no hit beyond the shared prefix, every eviction watched,
    the pool whole at the end; and the run must have exercised the cache (hits, evictions, a next turn finding its
    previous turn's reply). Returns (problems, the comparison report)."""
    report = compare(f"{on.config.forward}[{on.config.backend}] prefix cache on vs off on the shared-prefix "
                     f"workload", records_of(off), records_of(on), score, threshold, flip_cap, check_steps=False)
    problems = report.problems() + hit_problems(on, watch.hits) + \
        stats_problems(on.pool.cache, on.requests.values(), on.pool.page_size)
    stats = on.pool.cache.stats()
    if stats["prefix_evictions"] == 0 or watch.checked != stats["prefix_evictions"]:
        problems.append(f"{stats['prefix_evictions']} cached pages evicted, {watch.checked} watched: the pool was "
                        f"not tight enough, or evictions went unwatched")
    replies = [t.request_id for t in turns if t.after and
               on.requests[t.request_id].cached_prefix > on.requests[t.after].prompt_len]
    if stats["prefix_hit_pages"] == 0 or not replies:
        problems.append(f"no hit, or no next turn found a page its previous turn's reply filled: {stats}")
    if on.pool.num_owned or on.pool.num_free != on.pool.capacity:
        problems.append(f"pages still held after the run: {on.pool.owned}")
    return problems, report
