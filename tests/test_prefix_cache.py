"""Unit tests for the prefix cache's bookkeeping: engine/prefix_cache.py, the pool's counts and LRU, and the
scheduler's lookups and registrations. No model: a step is advanced as Engine.step does."""
from __future__ import annotations

import pytest

from engine.errors import PoolInvariantError
from engine.pool import PagePool
from engine.prefix_cache import ROOT, Chain, PrefixCache
from engine.request import Request, State
from engine.scheduler import Scheduler

P = 4


def make(num_pages=12, max_batch=8, chunk_tokens=64):
    pool = PagePool(num_pages, P, prefix_cache=True)
    return pool, Scheduler(pool, max_batch=max_batch, chunk_tokens=chunk_tokens)


def step(sched, token=7):
    plan = sched.schedule()
    plan.apply([token] * len(plan.sampled), 0.0)
    freed = sched.finish_step()
    return plan, freed


def serve(sched, *requests):
    for r in requests:
        sched.add(r)
    while any(not r.done for r in requests):
        step(sched)


def test_keys_chain_the_prefix_and_are_stable():
    c = PrefixCache()
    a, b = Chain(), Chain()
    c.extend(a, [1, 2, 3, 4, 9, 9, 9, 9], P, 2)
    c.extend(b, [5, 6, 7, 8, 9, 9, 9, 9], P, 2)
    assert a.keys[1] != b.keys[1], "the same ids after another prefix must get another key"
    assert len(a.keys[0]) == 16 and a.keys[0] == c.key((ROOT, (1, 2, 3, 4)))   # blake2b-128, no salt
    assert PrefixCache().key((ROOT, (1, 2, 3, 4))).hex() == a.keys[0].hex()


def test_a_hit_compares_what_was_hashed():
    c = PrefixCache()
    chain = Chain()
    c.extend(chain, [1, 2, 3, 4], P, 1)
    c.register(11, chain.keys[0], (ROOT, (9, 9, 9, 9)))     # a record whose ids differ from its key's
    assert c.key_of(11) == chain.keys[0]
    assert c.match(Chain(), [1, 2, 3, 4, 5], P, 1) == [], "a key match with other ids must not be a hit"


def test_identical_prompt_hits_all_but_its_last_position():
    for n, hit in [(2 * P - 1, P), (2 * P, P), (2 * P + 1, 2 * P)]:
        pool, sched = make()
        a = Request("a", list(range(1, n + 1)), 2)
        serve(sched, a)
        b = Request("b", list(range(1, n + 1)), 2)
        sched.add(b)
        plan, _ = step(sched)
        assert b.cached_prefix == hit, (n, b.cached_prefix)
        assert plan.chunks[0].start == hit and plan.chunks[0].length == n - hit
        assert pool.owned["b"][:hit // P] == pool.cache.match(Chain(), b.prompt, P, hit // P)
        pool.check()


def test_reserve_counts_only_pages_not_found_and_pins_the_hits():
    pool, sched = make(num_pages=6)          # 5 pages
    a = Request("a", list(range(1, 13)), 1)   # 12 + 1 slots: 4 pages; its 3 full prompt pages get cached
    serve(sched, a)
    assert pool.num_free == 5 and pool.num_cached == 3
    b = Request("b", list(range(1, 13)) + [50], 7)      # 20 slots: 5 pages, 3 found: needs the 2 free ones
    sched.add(b)
    assert not pool.can_reserve(24, []) and pool.can_reserve(20, pool.cache.match(Chain(), b.prompt, P, 3))
    plan = sched.schedule()
    assert plan.admitted == [b] and b.cached_prefix == 12
    shared = pool.owned["b"][:3]
    assert all(pool.refs[p] == 1 and p not in pool.cache.lru for p in shared)
    assert pool.take_evicted() == [], "free pages go first, before evicting a cached one"
    pool.check()


def test_eviction_takes_least_recently_used_unheld_pages_last_page_first():
    pool, sched = make(num_pages=7)          # 6 pages
    tables = {}
    for rid, x in (("a", 1), ("b", 4)):      # 2 full prompt pages get cached, the partial third is freed
        r = Request(rid, [x] * 4 + [x + 1] * 4 + [x + 2], 1)
        sched.add(r)
        sched.schedule()
        tables[rid] = list(pool.owned[rid])
        sched.plan.apply([7], 0.0)
        assert sched.finish_step() == [tables[rid][2]]
    a, b = tables["a"], tables["b"]
    assert list(pool.cache.lru) == [a[1], a[0], b[1], b[0]], "released longest ago first, last page first"
    assert pool.num_free == 6 and len(pool.free) == 2
    c = Request("c", [9] * 17, 3)             # 20 slots: 5 pages, nothing found: 2 free + 3 evicted
    sched.add(c)
    sched.schedule()
    assert pool.take_evicted() == [a[1], a[0], b[1]] and pool.take_evicted() == []
    assert list(pool.cache.lru) == [b[0]] and pool.cache.evictions == 3
    assert all(p not in pool.cache.by_page for p in (a[0], a[1], b[1]))
    pool.check()


def test_decode_pages_are_cached_and_a_next_turn_finds_them():
    pool, sched = make()
    a = Request("a", [1, 2, 3], 6)            # positions 3..7 are written by decode tokens: pages 0 and 1 fill
    serve(sched, a)
    turn = Request("t", a.prompt + a.output + [40, 41], 2)
    sched.add(turn)
    step(sched)
    assert turn.cached_prefix == 8, "the next turn should find the pages its previous turn's reply filled"


def test_equal_pages_computed_in_one_step_keep_the_earlier_request_s():
    pool, sched = make()
    a, b = Request("a", list(range(1, 10)), 1), Request("b", list(range(1, 10)), 1)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    pages_a, pages_b = list(pool.owned["a"]), list(pool.owned["b"])
    sched.plan.apply([7, 7], 0.0)
    sched.finish_step()
    assert [pool.cache.by_page.get(p) is not None for p in pages_a[:2]] == [True, True]
    assert all(p not in pool.cache.by_page for p in pages_b), "one page per hash: b's copies stay private"
    assert all(p in pool.free for p in pages_b), "b's uncached pages are freed (and poisoned) at the end"
    pool.check()


def test_cancel_drops_the_counts_at_the_end_of_the_step():
    pool, sched = make()
    a = Request("a", list(range(1, 10)), 8)
    serve(sched, a)
    b, c = Request("b", list(range(1, 10)), 8), Request("c", list(range(1, 10)), 8)
    sched.add(b)
    sched.add(c)
    step(sched)
    shared = pool.owned["b"][:2]
    assert shared == pool.owned["c"][:2] and all(pool.refs[p] == 2 for p in shared)
    sched.cancel("b", {"b": b})
    plan = sched.schedule()
    assert all(pool.refs[p] == 2 for p in shared), "counts drop at the end of the step, not at cancel"
    plan.apply([7] * len(plan.sampled), 0.0)
    sched.finish_step()
    assert all(pool.refs[p] == 1 for p in shared) and "b" not in pool.owned
    pool.check()


def test_check_names_page_hash_and_holders():
    pool, sched = make()
    serve(sched, Request("a", list(range(1, 10)), 1))
    b = Request("b", list(range(1, 10)), 4)
    sched.add(b)
    step(sched)
    page = pool.owned["b"][0]
    pool.refs[page] += 1
    with pytest.raises(PoolInvariantError, match=rf"page {page} \(hash [0-9a-f]{{12}}\) has count 2 but is held by 1: "
                                             rf"\['b'\]"):
        pool.check()
    pool.refs[page] -= 1
    pool.cache.park(page)
    with pytest.raises(PoolInvariantError, match=rf"page {page} \(hash [0-9a-f]{{12}}\) is evictable \(in the LRU\) "
                                             rf"while held by \['b'\]"):
        pool.check()


def test_the_pool_without_a_cache_shares_nothing():
    pool = PagePool(8, P)
    sched = Scheduler(pool, max_batch=4, chunk_tokens=64)
    a, b = Request("a", [1] * 9, 2), Request("b", [1] * 9, 2)
    serve(sched, a)
    serve(sched, b)
    assert b.cached_prefix == 0 and b.chunks[0] == (0, 9) and pool.num_cached == 0 and a.chain is None and b.chain is None
    assert pool.num_free == len(pool.free) == pool.capacity


def test_a_waiting_request_cancelled_leaves_no_chain():
    pool, sched = make(max_batch=1)
    a, b = Request("a", [1] * 9, 3), Request("b", [1] * 9, 3)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert b.state is State.WAITING
    sched.cancel("b", {"b": b})
    assert b.chain is None
