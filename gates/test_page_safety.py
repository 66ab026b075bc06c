"""Page safety gates: the tiny-pool gate (admission is the bottleneck; same tokens, every request completes, no
page leaks) and the soak gate (hundreds of arrivals with cancellations in a tight pool). Freed-page poisoning is
on in every run here, as in every gate."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine.errors import EngineDeadError, PoisonedLogitsError
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
    # the step was lost half-way: the engine is failed, and says so to every later call (it serves nothing wrong)
    for name, call in (("step()", e.step), ("submit()", lambda: e.submit([5, 6], 2)), ("results()", e.results)):
        try:
            call()
        except EngineDeadError as dead:
            assert "PoisonedLogitsError" in str(dead), f"EngineDeadError does not name its cause: {dead}"
        except Exception as other:  # noqa: BLE001 (any other answer is the finding)
            pytest.fail(f"after the PoisonedLogitsError the engine is not failed: {name} raised "
                        f"{type(other).__name__} ({str(other).splitlines()[0][:160]}), not EngineDeadError")
        else:
            pytest.fail(f"after the PoisonedLogitsError the engine is not failed: {name} returned, not "
                        f"EngineDeadError")


def kv_slots(runner) -> list[torch.Tensor]:
    """Each layer's K then V cache as [slots, heads * head_dim] views (slot = page * page_size + offset)."""
    return [t.view(t.shape[0] * runner.page_size, -1) for kv in runner.kv_caches for t in kv]


def cache_change(runner, want: list[torch.Tensor], skip: torch.Tensor) -> str | None:
    """Where the KV cache is not `want` (NaN matching NaN) outside the `skip` slots, in words; None: nowhere."""
    ps = runner.page_size
    for i, (t, w) in enumerate(zip(kv_slots(runner), want)):
        changed = ~((t == w) | (t.isnan() & w.isnan())).all(-1)
        changed[skip] = False
        if changed.any():
            at = changed.nonzero().flatten().tolist()
            kind = ("NaN" if w[at[0]].isnan().all() else "finite") + " -> " + \
                ("NaN" if t[at[0]].isnan().all() else "finite" if t[at[0]].isfinite().all() else "part NaN")
            return (f"layer {i // 2} {'KV'[i % 2]}, {len(at)} slots, first slot {at[0]} (page {at[0] // ps}, "
                    f"{kind})")
    return None


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_the_search_after_a_poisoned_page_read_names_the_slots_read(runs, opts, engine, backend):
    """What the canary's report rests on: the search that re-runs a poisoned step (engine/poisoned_reads.py) must
    name slots the reader's row depends on, one per page, at most max_reads, the poisoned ones before those written
    NaN by an earlier forward (that forward's read's effect, not the cause), and say whether the row reads NaN in
    other pages too; answer None only when the row stays non-finite with every NaN slot finite; take about
    log2(pages) + log2(page_size) forwards a slot; and leave the KV cache as found, but for the step's own slots,
    which each re-run writes again (written, never left NaN as if never written). The reader (the second of two
    decoding requests) gets single slots poisoned at known offsets of three of its pages (NaN in every layer, as a
    freed page) and a slot of a fourth NaN in the layers past the first only (as an earlier forward that read a
    poisoned slot writes it); around them the cache holds NaN the row does not read: the other request's and its own
    unwritten slots, the free pages. At that step's read-back the gate runs the search on that cache and on variants
    of it (the poisoned slots made finite: only the tainted one is read; one NaN slot in the whole cache; two, the
    lower one another request's; a slot holding inf and no NaN read: None), then lets the engine report the read:
    PoisonedLogitsError names the reader, a poisoned slot it read, its page and holder, and the other pages."""
    skip_unless_runs(opts, engine, backend)
    # serial steps (no step launched ahead writes the cache while the gate reads it), a small pool (cheap copies)
    hook = [lambda point: None]         # the step hook: armed for the poisoned step's read-back
    e = runs.engine_reference(engine, backend, workload_for(opts, "smoke-cpu"), overlap=False,
                              num_pages=12).engine(step_hook=lambda point: hook[0](point))
    runner, ps = e.runner, e.pool.page_size
    first = e.submit(list(range(7, 7 + ps // 2)), 16)
    rid = e.submit(list(range(5, 5 + 7 * ps // 2)), 16)
    for _ in range(20):
        if e.requests[rid].state is State.DECODE and e.requests[first].state is State.DECODE:
            break
        e.step()
    assert e.requests[rid].state is State.DECODE, "the request never started decoding"
    pages = e.pool.owned[rid]
    assert len(pages) >= 4 and e.requests[rid].num_cached > 3 * ps, f"{rid} holds pages {pages}: expected 4"
    position = {p * ps + o: i * ps + o for i, p in enumerate(pages) for o in range(ps)}   # slot -> rid's position
    poisoned = [pages[0] * ps + ps // 4, pages[1] * ps + ps // 2, pages[2] * ps + 3 * ps // 4]
    tainted = pages[3] * ps + 1
    flat = kv_slots(runner)
    for t in flat:
        t[poisoned] = float("nan")
    for t in flat[2:]:                  # layers past the first, keys and values
        t[tainted] = float("nan")
    layers = len(flat) // 2
    read = set(poisoned) | ({tainted} if layers > 1 else set())     # (a one-layer model holds no tainted slot)
    label = f"{engine}[{backend}]: {rid} reads NaN at slots {sorted(read)}"
    cap = [0]
    forwards = [0]
    run = runner.run

    def counted(*args, **kw):
        forwards[0] += 1
        assert forwards[0] <= cap[0], (
            f"{label}: the search ran {forwards[0]} forwards and goes on: it should take about log2(pages) + "
            f"log2(page_size) a slot ({cap[0]} in all here)")
        return run(*args, **kw)

    runner.run = counted
    per_slot = math.ceil(math.log2(runner.kv_caches[0][0].shape[0])) + math.ceil(math.log2(ps)) + 2

    def search(plan, pages_of, row, want, skip, own, max_reads, what):
        """The search on the cache `want`: its answer, the cache checked as found after it."""
        for t, w in zip(kv_slots(runner), want):
            t.copy_(w)
        forwards[0], cap[0] = 0, (max_reads + 2) * per_slot
        got = runner.poisoned_reads(plan, pages_of, e.config.forward, row, max_reads)
        left_cache(want, skip, own, f"searched with {what} (max_reads {max_reads})")
        return got

    def left_cache(want, skip, own, what):
        change = cache_change(runner, want, skip)
        assert change is None, f"{label}, {what}: the search left the KV cache changed: {change}"
        for i, t in enumerate(kv_slots(runner)[:2]):
            assert not t[own].isnan().any(), (
                f"{label}, {what}: the search left NaN in layer 0 {'KV'[i]} of the step's own slots {own.tolist()}, "
                f"which the step writes (from the token's embedding) before it reads: they look never written")

    def expect(got, slots, more, max_reads, what, nan_read=None):
        """`slots`: what the search must find (poisoned slots before tainted ones); `more`: whether the row reads
        NaN in other pages too; `nan_read`: the NaN slots the row reads in this cache (default `slots`)."""
        want = f"{sorted(slots)}, more {more}"
        assert got is not None, f"{label}, {what}: the search found nothing (None); expected {want}"
        found, also = got
        stray = sorted(set(found) - set(slots if nan_read is None else nan_read))
        assert not stray, (f"{label}, {what}: the search named slots {stray} (pages {[s // ps for s in stray]}), "
                           f"where the row reads no NaN; expected {want}")
        assert len(found) <= max_reads and len({s // ps for s in found}) == len(found), (
            f"{label}, {what}: the search named {found}: expected at most {max_reads} slots, one a page")
        assert sorted(found) == sorted(slots), (
            f"{label}, {what}: the search found {found}; expected {want} (the poisoned slots first: a tainted one is "
            f"an earlier read's effect, not the cause)")
        assert also is more, (f"{label}, {what}: the search found {found} and more {also}, but the row reads NaN "
                              f"in {'other pages too' if more else 'no other page'}")

    def at_read_back(point):
        if point != "read-back":
            return
        hook[0] = lambda point: None
        plan, pages_of = e.scheduler.plan, dict(e.pool.owned)
        row = [r.request_id for r in plan.sampled].index(rid)
        # the step's own slots: each decode row's next position, each chunk's positions
        own = [pages_of[r.request_id][r.num_cached // ps] * ps + r.num_cached % ps for r in plan.decodes]
        own += [pages_of[c.request.request_id][p // ps] * ps + p % ps for c in plan.chunks
                for p in range(c.start, c.start + c.length)]
        own = torch.tensor(own, device=runner.device)
        skip = own if runner.pad_page is None else torch.cat(     # the pad page: each replay's padding rows write it
            [own, torch.arange(runner.pad_page * ps, (runner.pad_page + 1) * ps, device=runner.device)])
        found = [t.clone() for t in kv_slots(runner)]
        holds_nan = torch.stack([t.isnan().any(-1) for t in found]).any(0)
        holds_nan[own] = False
        assert holds_nan[sorted(read)].all(), f"{label}: the step wrote over the planted slots"

        def variant(finite=(), nan_only=None):
            """The cache found, with `finite` slots made finite, or every NaN slot but `nan_only`."""
            v = [w.clone() for w in found]
            for w in v:
                if nan_only is None:
                    w[list(finite)] = 0.0
                else:
                    keep = w.isnan()
                    keep[nan_only] = False
                    w[keep] = 0.0
            return v

        args = plan, pages_of, row
        for m, slots, more in ((3, poisoned, layers > 1), (4, read, False)):
            if layers > 1 or m == 3:
                expect(search(*args, found, skip, own, m, "the cache found"), slots, more, m, f"max_reads {m}", read)
        if layers > 1:
            expect(search(*args, variant(finite=poisoned), skip, own, 1, "the poisoned slots made finite"),
                   [tainted], False, 1, "the poisoned slots made finite: only the tainted one is read")
        expect(search(*args, variant(nan_only=poisoned[:1]), skip, own, 1, "one NaN slot"), poisoned[:1], False,
               1, f"one NaN slot in the whole cache, {poisoned[0]}")
        # the lowest NaN slot the row cannot read: the other request's unwritten slots, or a free page
        other = next(s for s in holds_nan.nonzero().flatten().tolist() if s // ps not in {*pages, runner.pad_page})
        expect(search(*args, variant(nan_only=[other, poisoned[2]]), skip, own, 1, "two NaN slots"), poisoned[2:],
               False, 1, f"two NaN slots in the cache: {poisoned[2]}, read, and {other} (page {other // ps}), not read")
        inf = variant(finite=sorted(read))
        inf[1][pages[0] * ps + 1] = float("inf")       # layer 0 values: no NaN read, non-finite all the same
        got = search(*args, inf, skip, own, 1, "a slot holding inf")
        assert got is None, (f"{label}, no NaN slot read, one holding inf: the row stays non-finite with every NaN "
                             f"slot finite, so the search must answer None; it answered {got}")
        for t, w in zip(kv_slots(runner), found):      # as found, for the engine's own report
            t.copy_(w)
        at_read_back.found, at_read_back.skip, at_read_back.own = found, skip, own
        forwards[0], cap[0] = 0, 3 * per_slot

    hook[0] = at_read_back
    try:
        e.step()
    except PoisonedLogitsError as caught:
        err = caught
    else:
        pytest.fail(f"{label}, and the step caught nothing: poison mode saw no non-finite row")
    msg = str(err)
    assert err.reader == rid and err.slot in poisoned and err.page == err.slot // ps and err.reads == [err.slot], (
        f"{label}: the report named reader {err.reader!r}, slot {err.slot} (page {err.page}), reads {err.reads}: "
        f"expected {rid!r} and one of the poisoned slots {poisoned}, alone (max_reads 1)\n{msg}")
    assert err.owner.startswith(f"owned by {rid} (position {position[err.slot]})"), (
        f"{label}: slot {err.slot} is {rid}'s position {position[err.slot]}; the report says {err.owner!r}")
    assert f"{rid} also read NaN in other pages" in msg, (
        f"{label}: {rid} reads NaN in {len(read)} pages; the report names {err.reads} and not the others\n{msg}")
    left_cache(at_read_back.found, at_read_back.skip, at_read_back.own, "the engine's report")


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
