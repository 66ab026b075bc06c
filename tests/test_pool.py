"""Unit tests for engine/pool.py: rounding, reserve on admit, eviction at the end of the step, the null page."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import PoolInvariantError
from engine.pool import NULL_PAGE, PagePool, pages_for

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("slots, page_size, pages", [
    (0, 64, 0), (1, 64, 1), (63, 64, 1), (64, 64, 1), (65, 64, 2), (128, 64, 2), (129, 64, 3),
    (1, 256, 1), (255, 256, 1), (256, 256, 1), (257, 256, 2), (4096 + 256, 256, 17), (7, 1, 7),
])
def test_pages_for_rounds_up(slots, page_size, pages):
    assert pages_for(slots, page_size) == pages
    assert PagePool(4, page_size).pages_needed(slots) == pages


@pytest.mark.parametrize("num_pages, page_size", [(1, 64), (0, 64), (4, 0), (4, -64)])
def test_bad_pool_shape_is_refused(num_pages, page_size):
    with pytest.raises(ValueError, match="at least 2 pages|page_size must be >= 1"):
        PagePool(num_pages, page_size)


def test_fresh_pool():
    pool = PagePool(5, 64)
    assert pool.capacity == 4
    assert pool.num_free == 4
    assert pool.num_owned == 0
    assert sorted(pool.free) == [1, 2, 3, 4]
    assert NULL_PAGE not in pool.free
    pool.check()


def test_reserve_gives_whole_prompt_plus_budget_rounded_up():
    pool = PagePool(8, 64)
    pages = pool.reserve("a", 129)             # 3 pages
    assert len(pages) == 3 and len(set(pages)) == 3
    assert NULL_PAGE not in pages
    assert pool.owned["a"] == pages
    assert pool.num_free == 4 and pool.num_owned == 3
    assert not set(pages) & set(pool.free)
    pool.check()


def test_can_reserve_boundary():
    pool = PagePool(4, 64)                     # 3 pages, 192 slots
    assert pool.can_reserve(192)
    assert not pool.can_reserve(193)
    pool.reserve("a", 64)
    assert pool.can_reserve(128) and not pool.can_reserve(129)


def test_reserve_beyond_free_or_twice_is_refused():
    pool = PagePool(4, 64)
    with pytest.raises(PoolInvariantError, match="reserve of 4 pages with 3 free"):
        pool.reserve("a", 193)
    assert pool.num_free == 3 and not pool.owned          # nothing taken
    pool.reserve("a", 1)
    with pytest.raises(PoolInvariantError, match="'a' already owns pages"):
        pool.reserve("a", 1)
    assert pool.num_free == 2


def test_release_returns_pages_only_at_the_end_of_the_step():
    pool = PagePool(6, 64)
    a = pool.reserve("a", 100)
    pool.reserve("b", 10)
    pool.begin_step()
    assert pool.in_step
    pool.release("a")
    assert "a" not in pool.owned
    assert pool.num_free == 2                  # not yet: pending until end_step
    assert not set(a) & set(pool.free)
    assert pool.num_owned == 3                 # pending pages still count as owned
    pool.check()
    freed = pool.end_step()
    assert sorted(freed) == sorted(a)          # exactly the released pages (the runner poisons them)
    assert pool.num_free == 4 and not pool.in_step and not pool.pending
    pool.check()
    assert pool.end_step() == []               # nothing twice


def test_release_outside_a_step_waits_for_the_next_end_step():
    pool = PagePool(3, 64)
    pool.reserve("a", 64)
    pool.release("a")
    assert pool.num_free == 1
    assert not pool.can_reserve(128)
    assert len(pool.end_step()) == 1
    assert pool.num_free == 2


def test_a_page_knows_its_owner_then_its_last_owner_and_the_step_that_freed_it():
    pool = PagePool(5, 64)
    a = pool.reserve("a", 100)
    b = pool.reserve("b", 10)
    assert pool.holder(a[1]) == ("a", "owned") and pool.holder(b[0]) == ("b", "owned")
    assert pool.holder(4) == (None, "never owned")
    for step in range(2):                      # steps 0 and 1; "a" finishes in step 2
        pool.begin_step()
        pool.end_step()
    pool.begin_step()
    pool.release("a")
    assert pool.holder(a[0]) == ("a", "released")
    pool.end_step()
    assert pool.holder(a[0]) == ("a", "freed") and pool.last_owner[a[0]] == ("a", 2)
    assert a[0] in pool.reserve("c", 3 * 64)   # every free page: a freed page handed out again has a new owner
    assert pool.holder(a[0]) == ("c", "owned")


def test_the_null_page_is_never_handed_out():
    pool = PagePool(9, 64)
    for cycle in range(5):
        pool.begin_step()
        got = [p for i in range(4) for p in pool.reserve(f"c{cycle}-{i}", 128)]
        assert sorted(got) == list(range(1, 9))       # the whole pool, null page excluded
        assert not pool.can_reserve(1)
        for i in range(4):
            pool.release(f"c{cycle}-{i}")
        assert pool.num_free == 0
        assert sorted(pool.end_step()) == list(range(1, 9))
        pool.check()


def test_check_catches_corruption():
    pool = PagePool(4, 64)
    pool.reserve("a", 64)
    pool.free.append(pool.owned["a"][0])            # free and owned at once
    with pytest.raises(PoolInvariantError, match="free \\+ owned = 4 pages, capacity 3"):
        pool.check()
    pool.free.pop()
    pool.free[0] = pool.owned["a"][0]               # the right count, but a page twice
    with pytest.raises(PoolInvariantError, match="two owners"):
        pool.check()

    pool = PagePool(4, 64)
    pool.free[0] = NULL_PAGE
    with pytest.raises(PoolInvariantError, match="null page"):
        pool.check()

    pool = PagePool(4, 64)
    pool.free.pop()                                 # a page lost
    with pytest.raises(PoolInvariantError, match="free \\+ owned = 2 pages, capacity 3"):
        pool.check()


def test_release_of_a_non_owner_is_refused():
    pool = PagePool(4, 64)
    with pytest.raises(PoolInvariantError, match="release of 'ghost', which owns no pages"):
        pool.release("ghost")
    assert not pool.pending and pool.num_free == 3


# engine/pool.py and engine/errors.py alone, without the package's __init__ (which imports torch: seconds, and
# under -O without cached bytecode much more): the bookkeeping needs no torch.
BARE = ("import sys, types\n"
        f"pkg = types.ModuleType('engine'); pkg.__path__ = [{str(REPO / 'engine')!r}]; sys.modules['engine'] = pkg\n"
        "import engine.pool as p\n"
        "from engine.errors import PoolInvariantError\n"
        "assert 'torch' not in sys.modules\n")


def test_invariants_hold_under_python_O():
    """`python -O` strips asserts: the pool's checks must still raise, typed."""
    probe = subprocess.run([sys.executable, "-O", "-c", "assert False"], capture_output=True, text=True)
    assert probe.returncode == 0, f"asserts still on under -O: {probe.stderr}"
    code = BARE + """
caught = []
pool = p.PagePool(4, 64)
pool.reserve('a', 64)
for call in (lambda: pool.reserve('a', 64), lambda: pool.reserve('b', 1000), lambda: pool.release('x')):
    try:
        call()
    except PoolInvariantError as e:
        caught.append(str(e))
pool.free.append(pool.owned['a'][0])
cached = p.PagePool(4, 4, prefix_cache=True)      # the prefix cache's invariants too
cached.reserve('c', 4)
cached.refs[cached.owned['c'][0]] += 1
for check in (pool.check, cached.check):
    try:
        check()
    except PoolInvariantError as e:
        caught.append(str(e))
print('|'.join(caught))
"""
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    caught = out.stdout.strip().split("|")
    assert len(caught) == 5, caught
    assert "'a' already owns pages" in caught[0] and "reserve of 16 pages with 2 free" in caught[1]
    assert "which owns no pages" in caught[2] and "free + owned = 4 pages, capacity 3" in caught[3]
    assert "has count 2 but is held by 1: ['c']" in caught[4]


@pytest.mark.parametrize("module", ["pool.py", "prefix_cache.py"])
def test_no_invariant_is_an_assert(module):
    """An assert is gone under `python -O`: the pool's and the prefix cache's checks raise PoolInvariantError."""
    tree = ast.parse((REPO / "engine" / module).read_text())
    lines = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert)]
    assert not lines, f"engine/{module} checks with assert at lines {lines}: use require() / PoolInvariantError"
