"""Bounded memory (issue 16, slow): 5,000 requests through one engine on the small model, about a tenth of them
cancelled, each result popped once it is final (its id reused), the trace bounded: resident memory stays flat after
warm-up. The same soak without pop_result (main's engine keeps everything) is caught growing."""
from __future__ import annotations

import gc
import os
import random
import time

import pytest

from engine import Engine, EngineConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

CONFIG = EngineConfig(chunk_tokens=64, max_batch=16, num_pages=40, record_topk=2, trace_limit=200)
IN_FLIGHT = 24          # requests held at once: submitted and not yet popped
IDS = 50                # ids cycle through r0..r49: each is reused about 100 times
WARMUP = 1000           # requests before the baseline sample (allocator pools, torch's caches, the topk buffers)
SAMPLE_EVERY = 250
# Growth allowed after warm-up. Main's engine (nothing popped) grows about 3.8 KiB per request here, 15 MiB over the
# 4,000 requests after warm-up; with pop_result it grew 36 KiB. 2 MiB over 4,000 requests catches any leak of
# 512 bytes or more per request (less than one request's prompt list, Request and RequestResult objects), and
# leaves the allocator room for its own arenas.
GROWTH_BOUND = 2 << 20


def rss() -> int:
    """Resident bytes of this process (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(engine: Engine, n: int, pop: bool, seed: int = 0) -> tuple[list[tuple[int, int, float]], int]:
    """Serve `n` requests, IN_FLIGHT at a time, cancelling one now and then. Returns (requests submitted, resident
    bytes, seconds) every SAMPLE_EVERY requests, and how many were cancelled. `pop`: take each final result with
    pop_result (ids cycle)."""
    rng = random.Random(seed)
    inflight: set[str] = set()
    submitted, cancelled, curve, t0 = 0, 0, [], time.perf_counter()
    while submitted < n or inflight:
        while submitted < n and len(inflight) < IN_FLIGHT:
            rid = f"r{submitted % IDS}" if pop else f"r{submitted}"
            prompt = [rng.randrange(3, 4000) for _ in range(rng.randint(4, 40))]
            engine.submit(prompt, rng.randint(2, 8), rid)
            inflight.add(rid)
            submitted += 1
            if submitted % SAMPLE_EVERY == 0:
                gc.collect()
                curve.append((submitted, rss(), time.perf_counter() - t0))
        if rng.random() < 0.3:
            cancelled += engine.cancel(rng.choice(sorted(inflight))).cancelled
        engine.step()
        for rid in list(inflight):
            r = engine.requests[rid]
            if r.done and not any(x is r for x in engine.scheduler.running):
                if pop:
                    engine.pop_result(rid)
                inflight.discard(rid)
    return curve, cancelled


def growth(curve) -> int:
    base = next(m for k, m, _ in curve if k >= WARMUP)
    return max(m for k, m, _ in curve if k >= WARMUP) - base


def show(curve) -> str:
    return ", ".join(f"{k}: {m / 2**20:.2f} MiB ({t:.0f} s)" for k, m, t in curve)


def test_resident_memory_is_flat_over_5000_requests(loaded):
    e = Engine(CONFIG, loaded=loaded)
    curve, cancelled = soak(e, 5000, pop=True)
    print(f"\n{cancelled} of 5000 cancelled; resident memory by requests submitted: {show(curve)}")
    assert growth(curve) < GROWTH_BOUND, f"grew {growth(curve) / 2**20:.2f} MiB after warm-up: {show(curve)}"
    assert not e.requests and not e.topk and len(e.trace) == CONFIG.trace_limit, \
        (len(e.requests), len(e.topk), len(e.trace))
    assert not e.scheduler.chunk_extra and not e.scheduler.prepaid and not e.scheduler.chains
    assert len(e.pool.last_owner) < e.pool.num_pages
    assert e.pool.num_free == e.pool.capacity and cancelled > 300


def test_the_soak_catches_an_engine_that_keeps_every_request(loaded):
    """Main's behaviour: nothing released. 1,500 requests are enough to cross the bound."""
    e = Engine(CONFIG.with_(trace_limit=None), loaded=loaded)
    curve, _ = soak(e, 1500 + WARMUP // 2, pop=False)
    assert growth(curve) >= GROWTH_BOUND, f"a keep-everything engine grew only {growth(curve)} bytes: {show(curve)}"
