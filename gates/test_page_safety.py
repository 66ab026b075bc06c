"""Page safety gates: the tiny-pool gate (admission is the bottleneck; same tokens, every request completes, no
page leaks) and the soak gate (hundreds of arrivals with cancellations in a tight pool). Freed-page poisoning is
on in every run here, as in every gate."""
from __future__ import annotations

import random

import pytest

from engine.errors import PoisonedLogitsError
from engine.request import State
from engine.workload import Workload

from . import summary, triage
from .compare import compare, compare_request
from .runs import CANDIDATES, skip_unless_runs, tiny_pool_slots, workload_for
from .records import GenRecord
from .reference import EngineReference
from .schedule_check import check_engine


@pytest.mark.parametrize("record", [True, False], ids=["recording", "poison-alone"])
@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_a_read_of_a_poisoned_page_is_caught(runs, opts, engine, backend, record):
    """The canary of every page safety verdict: the second of two decoding requests gets its first page poisoned
    under it (as if freed while it still reads it): the engine must stop with PoisonedLogitsError naming that
    request and that page. Without it a
    poison mode that detected nothing (non-finite rows looked for along the wrong dimension, say) would pass every
    gate here; session 17's runner campaign found such mutants unseen. Both as the gates run (recording the top-k
    beside the poison mode) and with poison mode alone, as an engineer turns it on to debug: each step's read-back
    carries the non-finite rows only in poison mode and the top-k only in record mode, and session 18's campaign
    found a read-back that took one flag for the other unseen while every gate recorded. The second also serves at
    a prefill share below 1: the step a poisoned read stops ends without a measured duration, which the debt ledger
    must leave as it is (its survivors: a step without one accounted, and failing the engine with a TypeError)."""
    skip_unless_runs(opts, engine, backend)
    e = runs.engine_reference(engine, backend, workload_for(opts, "smoke-cpu"),
                              **({} if record else {"record_topk": 0, "prefill_share": 0.5})).engine()
    # two requests, the second's page poisoned: the report must name that row's request, not the first row's
    first = e.submit(list(range(7, 7 + e.pool.page_size // 2)), 16)
    rid = e.submit(list(range(5, 5 + 3 * e.pool.page_size // 2)), 16)
    for _ in range(20):
        if e.requests[rid].state is State.DECODE and e.requests[first].state is State.DECODE:
            break
        e.step()
    assert e.requests[rid].state is State.DECODE, "the request never started decoding"
    page = e.pool.owned[rid][0]
    e.runner.poison_pages([page])
    try:
        for _ in range(4):      # (a step launched ahead may have read the page before it was poisoned)
            e.step()
    except PoisonedLogitsError as caught:
        err = caught
    else:
        pytest.fail(f"page {page} was poisoned under {rid!r} while it decodes, and 4 steps read it unseen: poison "
                    f"mode caught nothing ({'recording the top-k' if record else 'poison mode alone'})")
    assert err.reader == rid and err.page == page, (
        f"the poisoned read was caught but named reader {err.reader!r}, page {err.page}: expected {rid!r}, {page}")


@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_tiny_pool(runs, opts, engine, backend, page_size):
    skip_unless_runs(opts, engine, backend)
    if engine == "flash" and page_size != 256:
        pytest.skip("flash decodes only 256-slot pages")
    workload = workload_for(opts, "mixed-cpu")
    full, _ = runs.candidate(engine, backend, workload)
    slots = tiny_pool_slots(opts, runs.loaded[0].shape)
    num_pages = slots // page_size + 1
    tiny, eng = runs.candidate(engine, backend, workload, page_size=page_size, num_pages=num_pages)
    blocked = sum(1 for s in eng.trace if s.admission_blocked)
    assert blocked > 0, "the capped pool never held admission back: the gate is not testing admission"
    assert all(r.state == "finished" for r in eng.results().values()), "not every request completed"
    # strict FCFS, reserve on admit, eviction at the end of the step and every page back, on this very run
    check_engine(eng, f"{engine}[{backend}] tiny pool ({num_pages - 1} pages of {page_size})")
    score = runs.reference(engine, workload).score
    report = compare(f"{engine}[{backend}] tiny pool ({num_pages - 1} pages of {page_size}) vs uncapped", full,
                     tiny, score, opts.threshold, opts.flip_cap, check_steps=False)
    summary.record(report)
    assert report.ok, triage.failure_message(report, eng, full, score)


SOAK = Workload("soak", (4, 16, 64, 256), (8, 32), 300, seed=99, chunk_tokens=128)


@pytest.mark.slow
@pytest.mark.parametrize("engine,backend", [("fused", "torch")])
def test_soak(runs, opts, engine, backend):
    """300 arrivals, a fifth of them cancelled at random points, in a pool of 48 pages."""
    skip_unless_runs(opts, engine, backend)
    specs = SOAK.requests(runs.loaded[0].shape.vocab_size)
    ref = EngineReference(engine, device=opts.device, dtype=opts.dtype, loaded=runs.loaded, backend=backend,
                          poison=True, chunk_tokens=SOAK.chunk_tokens)
    uncancelled = ref.generate(specs)
    soak = EngineReference(engine, device=opts.device, dtype=opts.dtype, loaded=runs.loaded, backend=backend,
                           poison=True, chunk_tokens=SOAK.chunk_tokens, num_pages=49).engine()
    rng = random.Random(5)
    to_cancel = {s.request_id: rng.randint(0, 40) for s in specs if rng.random() < 0.2}
    pending = list(specs)
    while pending or soak.scheduler.has_work:
        for _ in range(min(len(pending), rng.randint(0, 4))):
            s = pending.pop(0)
            soak.submit(s.prompt, s.budget, s.request_id)
        soak.step()
        for rid in list(to_cancel):
            if rid in soak.requests:
                to_cancel[rid] -= 1
                if to_cancel[rid] < 0:
                    soak.cancel(rid)
                    del to_cancel[rid]
    check_engine(soak, f"{engine}[{backend}] soak")
    res = soak.results()
    assert set(res) == {s.request_id for s in specs}
    failures = []
    for rid, r in res.items():
        ref_rec = uncancelled[rid]
        assert r.state in ("finished", "cancelled"), f"{rid} ended {r.state}"
        n = len(r.tokens)
        if r.state == "finished":
            assert n == len(ref_rec.tokens)
        cut = GenRecord(rid, ref_rec.prompt, ref_rec.tokens[:n], ref_rec.topk_ids[:n], ref_rec.topk_vals[:n])
        tk = soak.topk.get(rid, [])
        mine = GenRecord(rid, r.prompt, r.tokens, [t[0] for t in tk], [t[1] for t in tk])
        v = compare_request(cut, mine, ref.score, opts.threshold, check_steps=False)
        if v.failure:
            failures.append(v.failure.message())
    assert not failures, "survivors or cancelled prefixes differ from an uncancelled run:\n" + "\n".join(failures)
