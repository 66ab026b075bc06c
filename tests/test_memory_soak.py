"""Bounded memory (issues 16 and 34, slow): 20,000 requests through one engine on the small model, about a tenth of
them cancelled, each result popped once it is final (its id reused), the trace bounded: resident memory stays flat
after warm-up. The same soak without pop_result (everything kept), or with the whole schedule log kept, is caught
growing."""
from __future__ import annotations

import gc
import os
import random
import time
import tracemalloc

import pytest

from engine import Engine, EngineConfig
from engine.schedule_log import ScheduleLog

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

CONFIG = EngineConfig(chunk_tokens=64, max_batch=16, num_pages=40, record_topk=2, trace_limit=200)
IN_FLIGHT = 24          # requests held at once: submitted and not yet popped
IDS = 50                # ids cycle through r0..r49: each is reused about 400 times
WARMUP = 2000           # requests before the baseline sample (allocator pools, torch's caches, the topk buffers)
SAMPLE_EVERY = 250
REQUESTS = 20_000
# Growth allowed after warm-up. Issue 16's engine with pop_result still grew about 730 bytes a request through its
# schedule log (2.4 to 2.7 MiB over 4,000 requests); 1 MiB over the 18,000 requests after warm-up catches any leak
# of 60 bytes a request or more (less than one small object each), and leaves the allocator room for its arenas.
GROWTH_BOUND = 1 << 20


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


def test_resident_memory_is_flat_over_20000_requests(loaded):
    e = Engine(CONFIG, loaded=loaded)
    curve, cancelled = soak(e, REQUESTS, pop=True)
    print(f"\n{cancelled} of {REQUESTS} cancelled; grew {growth(curve) / 2**20:.3f} MiB after {WARMUP} requests; "
          f"resident memory by requests submitted: {show(curve)}")
    assert growth(curve) < GROWTH_BOUND, f"grew {growth(curve) / 2**20:.2f} MiB after warm-up: {show(curve)}"
    assert not e.requests and not e.topk and len(e.trace) == CONFIG.trace_limit, \
        (len(e.requests), len(e.topk), len(e.trace))
    assert not e.scheduler.ledger.chunk_extra and not e.scheduler.ledger.prepaid and all(r.chain is None for r in e.scheduler.running)
    log = e.scheduler.log
    assert not (log.admissions or log.waits or log.releases or log.ends)
    assert len(e.pool.last_owner) < e.pool.num_pages
    assert e.pool.num_free == e.pool.capacity and cancelled > REQUESTS // 20


def test_the_soak_catches_an_engine_that_keeps_every_request(loaded):
    """Issue 16's main: nothing released. 1,500 requests are enough to cross the bound."""
    e = Engine(CONFIG.with_(trace_limit=None), loaded=loaded)
    curve, _ = soak(e, 1500 + WARMUP, pop=False)
    assert growth(curve) >= GROWTH_BOUND, f"a keep-everything engine grew only {growth(curve)} bytes: {show(curve)}"


def retained_per_request(engine: Engine, n: int = 1000) -> float:
    """Python heap bytes a warm engine keeps per request served: the traced heap's growth over `n` requests, after a
    first traced window of 500 in which the bounded state (the last trace_limit steps, the pool's last owners)
    turns over. tracemalloc is exact where resident memory hides a few hundred bytes a request in the allocator's
    free arenas for thousands of requests."""
    soak(engine, 500, pop=True)
    tracemalloc.start()
    try:
        soak(engine, 500, pop=True, seed=1)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        soak(engine, n, pop=True, seed=2)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()


def test_the_soak_catches_a_kept_schedule_log(loaded):
    """Issue 34's main: results popped, but every admission, release and step end logged, about 730 bytes a
    request: 13 MiB over the soak's 18,000 requests after warm-up. The engine as served keeps none of it."""
    kept = retained_per_request(Engine(CONFIG, loaded=loaded, schedule_log=ScheduleLog()))
    served = retained_per_request(Engine(CONFIG, loaded=loaded))
    print(f"\nretained per request: {kept:.0f} bytes with the schedule log kept, {served:.0f} without")
    assert kept > 400 and kept * (REQUESTS - WARMUP) > GROWTH_BOUND, kept
    # measured: 601 bytes kept, 14 without (under 30: half the soak's bound)
    assert served * (REQUESTS - WARMUP) < GROWTH_BOUND / 2, served
