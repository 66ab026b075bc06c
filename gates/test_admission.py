"""Gate: the page pool's admission invariants (gates/admission_machine.py), over PagePool + Scheduler at three page sizes.

Settings come from the hypothesis profile that conftest.py loads (ci / dev / long).
"""
from __future__ import annotations

from .admission_machine import make_machine

# page_size 1: the smallest page the config accepts (a mutant refusing it survived the two sizes below)
AdmissionPage1 = make_machine(page_size=1)
AdmissionPage64 = make_machine(page_size=64)
AdmissionPage256 = make_machine(page_size=256)
TestAdmissionPage1 = AdmissionPage1.TestCase
TestAdmissionPage64 = AdmissionPage64.TestCase
TestAdmissionPage256 = AdmissionPage256.TestCase


# -- the pool's own check, and its guards, can fail ------------------------------------------------------------------
# The machines above call PagePool.check() after every rule and never see it fail: a check weakened (its per-page loop
# skipped, an `and` turned `or`) would pass them all. Each state below breaks one invariant the check states, as a
# bug would leave it, and the check must name it; the guards of reserve and register must refuse what no scheduler
# asks, with the pool's typed error, before they change anything.
def _pool_with_cached_pages():
    import hashlib
    from engine.pool import PagePool
    pool = PagePool(num_pages=8, page_size=4, prefix_cache=True)
    keys = [hashlib.sha256(bytes([i])).digest()[:16] for i in range(2)]
    pool.begin_step()
    pool.reserve("a", 8)                  # two pages, computed by a
    for i, key in enumerate(keys):
        pool.register("a", i, key, (i,))
    pool.end_step()
    pool.check()
    return pool, keys


def test_the_pool_check_fails_on_each_broken_invariant():
    import pytest
    from engine.errors import PoolInvariantError
    pool, _ = _pool_with_cached_pages()
    pool.reserve("b", 4)
    shared = pool.owned["b"][0]           # an uncached page in two requests' pages, each count right
    pool.owned["c"] = [shared]
    pool.refs[shared] = 2
    with pytest.raises(PoolInvariantError, match=f"page {shared} has two owners .* not a cached page"):
        pool.check()

    pool, _ = _pool_with_cached_pages()
    c = pool.cache
    a0, a1 = pool.owned["a"]
    c.by_key[c.by_page[a0].key] = c.by_page[a1]      # as many keys as pages, one key naming the other's page
    with pytest.raises(PoolInvariantError, match="key and page maps disagree"):
        pool.check()


def test_the_pool_guards_refuse_what_no_scheduler_asks():
    import pytest
    from engine.errors import PoolInvariantError
    pool, keys = _pool_with_cached_pages()
    hits = list(pool.owned["a"])          # a's two cached pages, as a later prompt with the same prefix finds them
    pool.release("a")
    pool.begin_step()
    pool.end_step()                       # cached, held by nobody: evictable, counted free
    assert pool.num_free == pool.capacity and all(p in pool.cache.lru for p in hits)
    before = (list(pool.free), dict(pool.refs), list(pool.cache.lru))
    # 7 free pages counting the 2 hits; with the hits pinned, 5 are left for the rest: 6 more is one too many
    with pytest.raises(PoolInvariantError, match="reserve of 6 pages with 5 free"):
        pool.reserve("b", 4 * 8, hits=hits)
    assert (list(pool.free), dict(pool.refs), list(pool.cache.lru)) == before and "b" not in pool.owned
    pool.check()

    pool.reserve("b", 4 * 3, hits=hits)   # its two hits (count 1 each: b alone holds them) and one new page
    with pytest.raises(PoolInvariantError, match="is shared or cached already"):
        pool.register("b", 0, keys[0], (0,))      # a hit is cached already: b did not compute it
    pool.check()

