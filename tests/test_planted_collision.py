"""Planted bugs the prefix cache's other gates passed (survivors of the mutation campaign, docs/mutation.md): the
collision gate (gates/prefix_collision.py) and the statistics check of the prefix machine and the on-vs-off gate must
fail on each, naming what went wrong. Each bug is a subclass; engine files stay untouched."""
from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from engine.pool import PagePool
from engine.prefix_cache import ROOT, PrefixCache
from engine.request import Request
from gates.prefix import stats_problems
from gates.prefix_collision import collision_problems
from gates.prefix_machine import make_prefix_machine

from tests.test_planted_prefix import FIND


class NoIdsCache(PrefixCache):
    """A hit compares the parent key alone, not the page's own ids (the mutant `(k + 1) // page_size`)."""

    def hashed_of(self, chain, tokens, page_size, k):
        return self.hash_input(chain.keys[k - 1] if k else ROOT, ())


class OwnKeyCache(PrefixCache):
    """A hit compares the page's own key where its parent's belongs (the mutant `keys[k - 0]`)."""

    def hashed_of(self, chain, tokens, page_size, k):
        return self.hash_input(chain.keys[k] if k else ROOT, tokens[k * page_size:(k + 1) * page_size])


class GoesOnCache(PrefixCache):
    """A lookup goes on past a page it did not find (the mutant `continue` for `break`)."""

    def match(self, chain, tokens, page_size, pages):
        self.extend(chain, tokens, page_size, pages)
        found = []
        for k in range(pages):
            entry = self.by_key.get(chain.keys[k])
            if entry is None or entry.hashed != self.hashed_of(chain, tokens, page_size, k):
                continue
            found.append(entry.page)
        return found


@pytest.mark.parametrize("cache_cls,scenario", [(NoIdsCache, "own tokens differ"), (OwnKeyCache, "parent differs"),
                                                (GoesOnCache, "own tokens differ")])
def test_collision_gate_fails_on_a_broken_guard(cache_cls, scenario):
    problems = collision_problems(cache_cls=cache_cls)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"a forced hash collision ({scenario}:") and "gave a false hit" in problems[0]


def test_collision_gate_passes_the_served_cache():
    assert collision_problems() == []


class CountsFromOneCache(PrefixCache):
    """The hit count starts at 1 (the mutant `self.hits = 1`)."""

    def __init__(self):
        super().__init__()
        self.hits = 1


class CountsFromOnePool(PagePool):
    def __init__(self, num_pages, page_size, prefix_cache=False):
        super().__init__(num_pages, page_size, prefix_cache)
        if prefix_cache:
            self.cache = CountsFromOneCache()


def test_prefix_machine_fails_on_a_wrong_hit_count():
    with pytest.raises(AssertionError, match=r"^the statistics count the lookups and hits violated: prefix cache "
                                             r"statistics .*'prefix_hit_pages': \(1, 0\)"):
        run_state_machine_as_test(make_prefix_machine(CountsFromOnePool, page_size=4), settings=FIND)


@pytest.mark.parametrize("field,value", [("lookups", 1), ("hits", 1)])
def test_stats_check_names_each_wrong_count(field, value):
    cache = PrefixCache()
    r = Request("r0", list(range(9)), 1)
    r.admit_step, r.cached_prefix = 0, 4
    cache.lookups, cache.hits = 2, 1            # (9 - 1) // 4 pages could be found, 1 was
    assert stats_problems(cache, [r], 4) == []
    setattr(cache, field, getattr(cache, field) + value)
    problems = stats_problems(cache, [r], 4)
    assert len(problems) == 1 and "prefix_hit_rate" in problems[0] and f"prefix_{field[:-1]}" in problems[0]


class ParkedBlindPool(PagePool):
    """Cached pages nobody holds counted as room and as hits at once (the mutant `parked()` returning 0 with the cache
    on): reserve on admit overcommits the pool exactly at its edge."""

    def parked(self, pages):
        return 0


def test_prefix_machine_fails_on_an_overcommitted_edge():
    with pytest.raises(AssertionError, match=r"^reservations exact violated: step \d+: schedule\(\) raised "
                                             r"KeyError\('dictionary is empty'\) admitting \['r\d+'\]"):
        run_state_machine_as_test(make_prefix_machine(ParkedBlindPool, page_size=4), settings=FIND)
