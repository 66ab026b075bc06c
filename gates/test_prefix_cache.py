"""Gates for the prefix cache (docs/DESIGN.md, "Prefix cache").

- on vs off: the shared-prefix workload (gates/prefix.py) served with the cache off, then on, in poison mode, more
  requests than rows, a pool that evicts cached pages mid-run: tokens under the 0.02 rule, no hit longer than what a
  request shares with those before it, the pool whole at the end, and the run must have hit, evicted and found a
  previous turn's reply;
- poison: every page evicted to admit a request is NaN in every layer before the step's forward, and held by its new
  owner alone as a page of its own (EvictionWatch); a step that read a NaN slot would fail the run (poison mode);
- the state machine over pool, cache and scheduler (gates/prefix_machine.py);
- the collision guard: hash collisions forced on purpose give no false hit (gates/prefix_collision.py).
"""
from __future__ import annotations

import pytest

from . import summary
from .runs import CANDIDATES, skip_unless_runs
from .prefix import pair_problems, serve_pair
from .prefix_collision import collision_problems
from .prefix_machine import make_prefix_machine


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_prefix_cache_on_vs_off(runs, opts, engine, backend):
    skip_unless_runs(opts, engine, backend)
    off, on, watch, turns = serve_pair(runs.loaded, engine, backend, opts.device, opts.dtype)
    problems, report = pair_problems(off, on, watch, turns, runs.reference(engine, "shared-prefix").score,
                                     opts.threshold, opts.flip_cap)
    summary.record(report)
    assert not problems, f"prefix cache on vs off ({on.pool.cache.stats()}):\n  " + "\n  ".join(problems)


PrefixPage4 = make_prefix_machine(page_size=4)
TestPrefixCachePage4 = PrefixPage4.TestCase
# the same machine at the torch kernels' page size: slower (longer prompts), so outside the default run
PrefixPage64 = make_prefix_machine(page_size=64)
TestPrefixCachePage64 = pytest.mark.slow(PrefixPage64.TestCase)


def test_a_forced_hash_collision_is_never_a_hit():
    problems = collision_problems()
    assert not problems, "\n".join(problems)
