"""Planted bugs: the prefix cache's state machine (gates/prefix_machine.py) must FAIL on each, with a message that
names the violated invariant, the page, its hash and the requests.

Each bug is planted by subclassing PagePool, PrefixCache or Scheduler (engine files stay untouched); the very state
machine of the gate runs against the bugged classes, derandomized, so the search is the same on every run.
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from engine.errors import PoolInvariantError
from engine.loader import load_model
from engine.pool import PagePool
from engine.prefix_cache import ROOT, PrefixCache
from engine.request import State
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from gates.failure import GateFailure
from gates.prefix import pair_problems, serve_pair
from gates.prefix_machine import make_prefix_machine
from gates.reference import EngineReference

FIND = settings(max_examples=500, stateful_step_count=40, derandomize=True, database=None, deadline=None,
                report_multiple_bugs=False, suppress_health_check=list(HealthCheck), phases=[Phase.generate])


class EvictsReferencedPool(PagePool):
    """(1) A hit pins its page but leaves it in the LRU: the next eviction can take a page a request still reads."""

    def pin(self, page):
        self.refs[page] = self.refs.get(page, 0) + 1


class PrefixBlindCache(PrefixCache):
    """(2) A page's hash (and what a hit compares) without its prefix: the same ids after another prefix hit."""

    def hash_input(self, parent, tokens):
        return (ROOT, tuple(tokens))


class PrefixBlindPool(PagePool):
    def __init__(self, num_pages, page_size, prefix_cache=False):
        super().__init__(num_pages, page_size, prefix_cache)
        if prefix_cache:
            self.cache = PrefixBlindCache()


class CancelKeepsCountsScheduler(Scheduler):
    """(3) A cancelled request's pages leave it without their counts going down."""

    def finish_step(self, duration=None):
        pool = self.kv.pool
        for r in self.running:
            if r.state is State.CANCELLED and r.request_id in pool.owned:
                pool.owned[r.request_id] = []
        return super().finish_step(duration)


class RecomputesLastCachedScheduler(Scheduler):
    """(4) A hit recomputes its last cached position (for logits), writing into a cached page that may be shared."""

    def admit_one(self, r, hits):
        super().admit_one(r, hits)
        if hits:
            r.num_cached -= 1


class SharedCache(PrefixCache):
    """(5) A copy of the cache (poison mode's foresight of the freed pages runs a step's end on a copy of the
    scheduler, engine/foresight.py) that is the cache itself: the look ahead caches and evicts real pages."""

    def __deepcopy__(self, memo):
        return self


class SharedCachePool(PagePool):
    def __init__(self, num_pages, page_size, prefix_cache=False):
        super().__init__(num_pages, page_size, prefix_cache)
        if prefix_cache:
            self.cache = SharedCache()


PLANTED = {
    "foresight-copy-shares-the-cache": (SharedCachePool, Scheduler,
                                        r"^the pages foreseen freed are the step's own violated: step \d+: "
                                        r"pages_freed_by\(\) changed the real pool"),
    "evicted-referenced-page": (EvictsReferencedPool, Scheduler,
                                r"^no referenced page is evicted violated: .*page \d+ \(hash [0-9a-f]{12}; held by "
                                r"\['r\d+'"),
    "hash-without-prefix": (PrefixBlindPool, Scheduler,
                            r"^a hit holds the request's own prefix violated: step \d+: r\d+ found page \d+ \(hash "
                            r"[0-9a-f]{12};.*computed by r\d+\).*a false hit"),
    "count-kept-on-cancel": (PagePool, CancelKeepsCountsScheduler,
                             r"^a page's count equals its holders violated: page \d+ \(hash ([0-9a-f]{12}|none); held "
                             r"by nobody; last held by \['r\d+ \(cancelled\)'\].*\) has count 1, but 0 requests "
                             r"hold it"),
    "cached-page-written": (PagePool, RecomputesLastCachedScheduler,
                            r"^no referenced or cached page is written violated: step \d+: r\d+ writes positions "
                            r"\[\d+, \d+\) into page \d+ \(hash [0-9a-f]{12};.*computed by r\d+\)"),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_gate_fails_on_planted_bug(bug):
    pool_cls, scheduler_cls, message = PLANTED[bug]
    with pytest.raises(AssertionError, match=message):
        run_state_machine_as_test(make_prefix_machine(pool_cls, scheduler_cls, page_size=4), settings=FIND)


# -- in a served engine: the on-vs-off gate and its eviction watch (gates/prefix.py) -----------------------------
@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32, "cpu")


def test_on_vs_off_gate_fails_on_a_hash_without_its_prefix(loaded):
    off, on, watch, turns = serve_pair(loaded, "fused", "torch", "cpu", "float32", pool_cls=PrefixBlindPool)
    problems, _ = pair_problems(off, on, watch, turns, EngineReference("fused", loaded=loaded).score, 0.02, 3)
    assert any(re.search(r"^bait-\d+ started at position 128 \(found cached\) but shares only \d+ positions .*a "
                         r"false hit: it found pages \(page, hash\) \[\(\d+, '[0-9a-f]{12}'\), \(\d+, '[0-9a-f]{12}'\)",
                         p) for p in problems), problems


def test_eviction_watch_fails_on_an_evicted_referenced_page(loaded):
    # the watch names the eviction, or (checked first) the pool a held page it would evict
    with pytest.raises((AssertionError, PoolInvariantError), match=r"^(step \d+: page \d+ \(hash [0-9a-f]{12} when evicted\) is held by "
                                             r"\[('[\w-]+', )+'[\w-]+'\]; only the request admitted for it|page \d+ "
                                             r"\(hash [0-9a-f]{12}\) is evictable \(in the LRU\) while held by "
                                             r"\['[\w-]+'\])"):
        serve_pair(loaded, "fused", "torch", "cpu", "float32", pool_cls=EvictsReferencedPool)


def test_eviction_watch_fails_on_an_evicted_page_left_unpoisoned(loaded, monkeypatch):
    """A runner that poisons no page: an evicted page keeps its old K/V when its new owner is admitted."""
    monkeypatch.setattr(ModelRunner, "poison_pages", lambda self, pages: None)
    with pytest.raises(GateFailure, match=r"^step \d+: page \d+ \(hash [0-9a-f]{12} when evicted, now [\w-]+'s page "
                                          r"\d+\) has \d+ finite K/V values in layer 0 before its new owner's first "
                                          r"write: an evicted page must be NaN before reuse"):
        serve_pair(loaded, "fused", "torch", "cpu", "float32")
