"""Gates for the prefill share (docs/DESIGN.md, "Prefill share"): only the order of whole steps changes.

- exactness: on the mixed workload, in poison mode, every request's tokens AND its prompt chunk boundaries are
  identical for p in {1, 0.75, 0.5, 0.25}; the p < 1 runs must really have withheld long-prompt pieces (or the gate
  proves nothing), and every chunk is a whole piece [k*C, min((k+1)*C, L));
- cancellation: requests cancelled while waiting, mid-prefill (between chunks) and mid-decode keep exactly a prefix
  of what an uncancelled run emits, and their provenance (gates/schedule_check.py) adds up to the step trace;
  every other request's tokens are identical to the uncancelled run; a cancelled
  request's pages return at the end of the next step and the pool is whole at the end; cancelling an unknown,
  finished or already cancelled id is a no-op with a clear outcome;
- the debt rule itself, as a hypothesis property over the scheduler alone (no model, synthetic step durations):
  while a long prompt fills and requests decode, the decoders' share of the time (pure decode time against the
  prompt work's extra time) is 1 - p, within one pure decode step per cycle, or what the saturation cap allows;
  nothing is withheld while nobody decodes; a short prompt never waits.

The checks live in gates/prefill_share_check.py, where tests/test_planted_prefill_share.py runs them against planted
bugs.
"""
from __future__ import annotations

import pytest
from hypothesis import example, given, strategies as st

from engine.pool import PagePool
from engine.request import Request
from engine.scheduler import Scheduler
from engine.workload import get_workload

from .runs import CANDIDATES, skip_unless_runs
from .prefill_share_check import (CAP_EXAMPLES, DEBT_CASE, STEP_EXAMPLES, apply, assert_no_problems, check_debt_rule,
                                  check_decode_estimate, check_identical, chunk_problems)
from .reference import EngineReference
from .traffic import Traffic

SHARES = (1.0, 0.75, 0.5, 0.25)
WORKLOAD = "mixed-cpu"


# -- exactness across p ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_tokens_and_chunks_identical_across_prefill_share(runs, opts, engine, backend):
    """Tokens and per-request chunk boundaries are identical for p in SHARES on the mixed workload (poison mode),
    and the p < 1 runs withheld long-prompt pieces (so the schedule did change)."""
    skip_unless_runs(opts, engine, backend)
    chunk_tokens = get_workload(WORKLOAD).chunk_tokens
    _, base_engine = runs.candidate(engine, backend, WORKLOAD)           # the default, p = 1 (shared with test_tokens)
    base = base_engine.results()
    problems = chunk_problems(base, chunk_tokens, "p=1")
    assert base_engine.scheduler.ledger.prefill_share == 1.0 and base_engine.scheduler.withheld_steps == 0
    for p in SHARES[1:]:
        _, e = runs.candidate(engine, backend, WORKLOAD, prefill_share=p)
        assert e.pool.num_free == e.pool.capacity, f"p={p}: pages leaked, the pool is not whole after the run"
        assert e.scheduler.withheld_steps > 0, \
            f"p={p}: no step withheld a long-prompt piece, so this run proves nothing about the prefill share"
        res = e.results()
        problems += chunk_problems(res, chunk_tokens, f"p={p}")
        problems += check_identical(base, res, "p=1", f"p={p}")
    assert_no_problems(problems, f"{engine}[{backend}] on {WORKLOAD} across prefill_share {SHARES}")


# -- cancellation ------------------------------------------------------------------------------------------------

# p = 1: the request gate's fused[torch] case (gates/test_requests.py) makes the same cancels, and more, on the same
# configuration and workload
@pytest.mark.parametrize("p", [0.5])
def test_cancellation_leaves_the_others_identical(runs, opts, p):
    """Cancel requests while waiting, mid-prefill (between chunks), mid-decode and during a step's forward (its
    decode row emits nothing, top-k included) while the prefill share withholds long prompts' pieces; the others'
    tokens are identical to an uncancelled run, the cancelled ones keep a prefix, pages come back at the end of the
    next step (gates/traffic.py). gates/test_requests.py runs the same cancels, and refused requests, on every engine
    configuration as served."""
    engine, backend = "fused", "torch"
    skip_unless_runs(opts, engine, backend)
    wl = get_workload(WORKLOAD)
    _, ref_engine = runs.candidate(engine, backend, WORKLOAD)
    traffic = Traffic(label=f"fused[torch] at p={p}")
    traffic.engine(EngineReference(engine, device=opts.device, dtype=opts.dtype, loaded=runs.loaded,
                                   backend=backend, poison=True, chunk_tokens=wl.chunk_tokens, prefill_share=p))
    traffic.serve(wl.requests())
    assert_no_problems(traffic.check(ref_engine.results()),
                       f"cancellation at p={p} ({len(traffic.cancelled)} cancelled: {traffic.cancelled})")


# -- the debt rule, as a property (no model) ---------------------------------------------------------------------
@given(**DEBT_CASE)
@example(**CAP_EXAMPLES[0])
@example(**CAP_EXAMPLES[1])
@example(**CAP_EXAMPLES[2])
@example(**STEP_EXAMPLES[0])
@example(**STEP_EXAMPLES[1])
@example(**STEP_EXAMPLES[2])
def test_debt_rule(p, t_decode, extra_ratio, budgets, long_pieces, chunk_tokens, warmup, last_ratio, tail):
    check_debt_rule(Scheduler, p, t_decode, extra_ratio, budgets, long_pieces, chunk_tokens, warmup, last_ratio, tail)


@given(durations=st.lists(st.floats(0.001, 0.2), min_size=2, max_size=30))
def test_decode_estimate(durations):
    """t_d, which the debt is paid in, follows the pure decode steps as documented (an EWMA, 1/4 on the newest)."""
    check_decode_estimate(Scheduler, durations)


def test_debt_rule_measures_something():
    """The property's examples are not vacuous: decoders keep 1 - p of the time over many cycles."""
    for p in (0.75, 0.5, 0.25):
        m = check_debt_rule(Scheduler, p, 0.01, 3.0, [2000, 2000], 8, 128)
        assert m["cycles"] >= 6 and m["withheld"] > 0 and abs(m["share"] - (1 - p)) < 0.08, m


@given(p=st.sampled_from([0.1, 0.25, 0.5, 0.75]), chat_len=st.integers(1, 512), at=st.integers(0, 30),
       chunk_tokens=st.sampled_from([64, 128, 512]), n_decoders=st.integers(0, 3))
def test_a_short_prompt_never_waits(p, chat_len, at, chunk_tokens, n_decoders):
    """A prompt with at most 512 positions left gets its first piece in the very next step, whatever the debt, as
    long as no earlier short prompt is reading."""
    C = chunk_tokens
    pool = PagePool(800, 64)
    sched = Scheduler(pool, max_batch=64, chunk_tokens=C, prefill_share=p)
    for i in range(n_decoders):
        sched.add(Request(f"d{i}", [1] * 4, 500))
    longp = Request("long", [1] * 40000, 1)
    sched.add(longp)
    chat = Request("chat", [1] * chat_len, 3)
    for i in range(at + 1):
        plan = sched.schedule()
        apply(plan)
        sched.finish_step(duration=0.01 + 0.04 * plan.prompt_positions / C)
    assert longp.prompt_left > 512
    sched.add(chat)
    plan = sched.schedule()
    got = [(c.request.request_id, c.start, c.length) for c in plan.chunks]
    assert got and got[0] == ("chat", 0, min(C, chat_len)), \
        f"a short chat arriving with debt {sched.ledger.debt:.3g} s got {got} in its first step"


def test_two_long_chunks_in_one_step_share_its_extra_time():
    """A step that carries two prompts' long chunks: each prompt's estimate of its chunk's extra time, from which its
    last long chunk pays its debt ahead, is half the step's extra time. Chunks end at multiples of chunk_tokens, so
    two long chunks share a step only after prefix hits at other offsets: with chunks of 512 and pages of 64, A finds
    64 positions cached and B 960, so A's chunk (448) and B's (64) fill one step; B's next chunk is its last long one
    and pays (extra / 2) (1 - p) / p ahead. Session 17's survivor: extra * 2 there passed every gate."""
    p, t_d, per_position = 0.5, 0.01, 1e-4
    sched = Scheduler(PagePool(400, 64, prefix_cache=True), max_batch=64, chunk_tokens=512, prefill_share=p,
                      short_prompt_positions=100)
    shared = list(range(1, 1101))
    sched.add(Request("seed", shared, 1))              # caches the prefix A and B begin with
    for i in range(2):
        sched.add(Request(f"d{i}", [7] * 4, 2000))
    both, added = None, False
    for _ in range(400):
        if not added and sched.step_index > 0 and all(r.request_id != "seed" for r in sched.running):
            sched.add(Request("A", shared[:64] + [9] * 2000, 1))
            sched.add(Request("B", shared[:960] + [8] * 600, 1))
            added = True
        plan = sched.schedule()
        if "B" in sched.ledger.prepaid:
            break
        longs = sorted(c.request.request_id for c in plan.chunks if c.long)
        extra = per_position * plan.prompt_positions
        if longs == ["A", "B"]:
            both = extra
        apply(plan)
        sched.finish_step(duration=(t_d if plan.decodes else 0.0) + extra)
    else:
        raise AssertionError("B's last long chunk never paid ahead")
    assert both is not None, "no step carried A's and B's long chunks together: the case tests nothing"
    want = both / 2 * (1 - p) / p
    got = sched.ledger.prepaid["B"]
    assert got == pytest.approx(want, rel=1e-6), (
        f"B's last long chunk paid {got:.4g} s ahead; its previous chunk shared a step of {both:.4g} s extra time "
        f"with A's, so its estimate is half of that and it owes {want:.4g} s")


def test_a_cancelled_prompt_gives_back_what_was_charged_ahead_for_it():
    """A long prompt cancelled after its last long chunk paid its debt ahead (the chunk withheld, the decoders
    paying the debt down): what was charged for it is owed to nobody, and the debt drops by it, never below 0.
    Session 17's survivor: a floor of -1 s there passed every gate (the debt went negative: credit)."""
    p, t_d = 0.5, 0.01
    sched = Scheduler(PagePool(200, 64), max_batch=64, chunk_tokens=128, prefill_share=p, short_prompt_positions=100)
    for i in range(2):
        sched.add(Request(f"d{i}", [1] * 4, 2000))
    requests = {}
    for i in range(400):
        if i == 3:
            requests["long"] = Request("long", [1] * (100 + 128 * 2 + 37), 1)
            sched.add(requests["long"])
        plan = sched.schedule()
        apply(plan)
        sched.finish_step(duration=(t_d if plan.decodes else 0.0) + 4e-4 * plan.prompt_positions)
        charged = sched.ledger.prepaid.get("long", 0.0)
        if charged > 0 and sched.ledger.debt < charged:
            break
    else:
        raise AssertionError("the last long chunk never paid ahead, or the decoders never paid it down")
    before = sched.ledger.debt
    assert sched.cancel("long", requests).outcome == "cancelled"
    plan = sched.schedule()
    assert not plan.chunks, "a cancelled prompt's chunk ran"
    apply(plan)
    sched.finish_step(duration=t_d)
    want = max(0.0, max(0.0, before - t_d) - charged)
    assert sched.ledger.debt == pytest.approx(want, abs=1e-12) and sched.ledger.debt >= 0.0, (
        f"cancelled with {before:.4g} s owed, {charged:.4g} s of it charged ahead for its last long chunk: after a "
        f"pure decode step of {t_d} s the debt is {sched.ledger.debt:.4g} s, expected {want:.4g} s")


def owed_scheduler(short: int, C: int = 128) -> Scheduler:
    """Two decoders and a 40,000-position prompt at share 0.25, stepped until the ledger owes decode time."""
    sched = Scheduler(PagePool(800, 64), max_batch=64, chunk_tokens=C, prefill_share=0.25,
                      short_prompt_positions=short)
    for i in range(2):
        sched.add(Request(f"d{i}", [1] * 4, 500))
    sched.add(Request("long", [1] * 40000, 1))
    for _ in range(60):
        plan = sched.schedule()
        apply(plan)
        sched.finish_step(duration=0.01 + 0.04 * plan.prompt_positions / C)
        if sched.ledger.owes:
            return sched
    raise AssertionError("no debt after 60 steps: the bound could not be tested")


@pytest.mark.parametrize("short", [0, 1, 100])
def test_the_short_prompt_bound(short):
    """EngineConfig.short_prompt_positions at its edges (0 is valid: no prompt is short, every one obeys the debt):
    while the debt is owed, a prompt of exactly `short` positions gets its first piece in the next step and one of
    short + 1 is withheld. A mutant that refused 0 passed the gates (none ran the bound)."""
    for n, goes in ((short, True), (short + 1, False)):
        if n == 0:
            continue
        sched = owed_scheduler(short)
        r = Request("probe", [1] * n, 1)
        sched.add(r)
        took = any(c.request is r for c in sched.schedule().chunks)
        assert took == goes, (f"a prompt of {n} positions (short_prompt_positions={short}) "
                              f"{'waited' if goes else 'went first'} while the debt was owed")
