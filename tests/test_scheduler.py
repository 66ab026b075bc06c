"""Unit tests for engine/scheduler.py: strict FCFS admission, max batch rows, prompt-chunk picking, step kinds,
eviction at the end of the step, and cancel outcomes. No model: a step is advanced as Engine.step does."""
from __future__ import annotations

import pytest

from engine.pool import PagePool
from engine.request import Request, State
from engine.scheduler import CancelResult, Chunk, Scheduler


def make(num_pages=9, page_size=64, max_batch=32, chunk_tokens=512):
    pool = PagePool(num_pages, page_size)
    return pool, Scheduler(pool, max_batch=max_batch, chunk_tokens=chunk_tokens)


def req(rid, prompt_len, budget):
    return Request(rid, [1] * prompt_len, budget)


def advance(plan):
    """Apply a plan's work exactly as Engine.step does (chunks, then decode tokens, then the sampled tokens)."""
    plan.apply([0] * len(plan.sampled), 0.0)


def full_step(sched):
    plan = sched.schedule()
    advance(plan)
    sched.finish_step()
    return plan


def ids(rs):
    return [r.request_id for r in rs]


def test_bad_scheduler_shape_is_refused():
    pool = PagePool(4, 64)
    with pytest.raises(ValueError, match="max_batch and chunk_tokens must be >= 1"):
        Scheduler(pool, max_batch=0)
    with pytest.raises(ValueError, match="max_batch and chunk_tokens must be >= 1"):
        Scheduler(pool, chunk_tokens=0)


def test_add_numbers_arrivals_and_queues_in_order():
    _, sched = make()
    rs = [req(f"r{i}", 10, 2) for i in range(3)]
    for r in rs:
        sched.add(r)
    assert [r.arrival_index for r in rs] == [0, 1, 2]
    assert ids(sched.waiting) == ["r0", "r1", "r2"]
    assert sched.has_work


def test_strict_fcfs_the_head_blocks_a_later_request_that_fits():
    pool, sched = make(num_pages=5)                 # 4 pages of 64
    big, blocked, small = req("big", 150, 20), req("blocked", 100, 20), req("small", 10, 5)   # 3, 2, 1 pages
    for r in (big, blocked, small):
        sched.add(r)
    plan = sched.schedule()
    assert ids(plan.admitted) == ["big"]
    assert pool.num_free == 1                       # "small" would fit, but "blocked" is ahead of it
    assert ids(sched.waiting) == ["blocked", "small"]
    assert small.state is State.WAITING and "small" not in pool.owned
    advance(plan)
    sched.finish_step()
    while big.state is not State.FINISHED:          # the head stays blocked while big holds its pages
        plan = sched.schedule()
        assert plan.admitted == []
        advance(plan)
        sched.finish_step()
    assert pool.num_free == 4                       # big's pages came back at the end of its last step
    plan = sched.schedule()
    assert ids(plan.admitted) == ["blocked", "small"]   # arrival order
    assert [r.admit_step for r in plan.admitted] == [plan.index] * 2
    assert len(pool.owned["blocked"]) == 2 and len(pool.owned["small"]) == 1


def test_admission_is_reserve_on_admit_rounded_up():
    pool, sched = make(num_pages=9)
    for rid, p, b in [("a", 64, 1), ("b", 63, 1), ("c", 100, 29)]:    # 65 slots -> 2, 64 -> 1, 129 -> 3
        sched.add(req(rid, p, b))
    sched.schedule()
    assert {rid: len(pages) for rid, pages in pool.owned.items()} == {"a": 2, "b": 1, "c": 3}
    assert pool.num_free == 2


def test_max_batch_rows():
    pool, sched = make(num_pages=9, max_batch=2)
    rs = [req(f"r{i}", 5, 1 + i) for i in range(4)]
    for r in rs:
        sched.add(r)
    plan = sched.schedule()
    assert ids(plan.admitted) == ["r0", "r1"]          # pages for all four, rows for two
    assert pool.num_free == 6
    advance(plan)                                       # r0 (budget 1) finishes in this step...
    assert rs[0].state is State.FINISHED
    sched.finish_step()
    plan = sched.schedule()                             # ...and its row is free only at the next step
    assert ids(plan.admitted) == ["r2"]
    assert ids(sched.running) == ["r1", "r2"]
    assert len(sched.running) <= sched.max_batch


def test_max_batch_row_of_a_finished_request_is_held_until_the_end_of_the_step():
    pool, sched = make(max_batch=1)
    a, b = req("a", 5, 1), req("b", 5, 1)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    advance(plan)
    assert a.state is State.FINISHED
    assert ids(sched.running) == ["a"]                  # retired only by finish_step
    sched.finish_step()
    assert ids(sched.schedule().admitted) == ["b"]


def chunks(plan):
    return [(c.request.request_id, c.start, c.length) for c in plan.chunks]


def test_chunks_are_whole_pieces_fcfs_within_chunk_tokens():
    """Pieces [k*C, (k+1)*C) of each prompt, taken FCFS while they fit; a piece that does not fit waits (never cut)."""
    _, sched = make(num_pages=9, chunk_tokens=100)
    r0, r1, r2 = req("r0", 150, 2), req("r1", 30, 2), req("r2", 80, 2)
    for r in (r0, r1, r2):
        sched.add(r)

    plan = sched.schedule()
    assert chunks(plan) == [("r0", 0, 100)]             # the earliest takes the whole budget
    assert plan.prompt_positions == 100 and plan.kind == "chunk-only"
    assert not plan.chunks[0].completes_prompt
    advance(plan)
    sched.finish_step()

    plan = sched.schedule()
    assert chunks(plan) == [("r0", 100, 50), ("r1", 0, 30)]    # r2's piece (80) does not fit in the 20 left
    assert [c.completes_prompt for c in plan.chunks] == [True, True]
    assert plan.prompt_positions == 80
    advance(plan)
    sched.finish_step()
    assert r0.output == [0] and r1.output == [0] and r2.output == []

    plan = sched.schedule()
    assert chunks(plan) == [("r2", 0, 80)]
    assert ids(plan.decodes) == ["r0", "r1"]            # admission order
    assert plan.kind == "loaded"
    assert (r0.chunks, r1.chunks, r2.chunks) == ([(0, 100), (100, 50)], [(0, 30)], [(0, 80)])


def test_short_prompts_go_before_a_long_prompts_next_piece():
    """A prompt with at most short_prompt_positions left goes first, even if it arrived later; admission stays FCFS."""
    pool = PagePool(40, 64)
    sched = Scheduler(pool, chunk_tokens=128, short_prompt_positions=200)
    long_, chat = req("long", 1000, 2), req("chat", 40, 2)
    sched.add(long_)
    full_step(sched)
    sched.add(chat)
    plan = sched.schedule()
    assert chunks(plan) == [("chat", 0, 40)]            # the long piece (128) no longer fits in the 88 left
    advance(plan)
    sched.finish_step()
    plan = sched.schedule()
    assert chunks(plan) == [("long", 128, 128)]
    advance(plan)
    sched.finish_step()
    while long_.state is State.PREFILL:
        full_step(sched)
    assert long_.chunks == [(k * 128, min(128, 1000 - k * 128)) for k in range(8)]
    assert all(c[0] % 128 == 0 for c in long_.chunks)


def test_chunk_boundaries_do_not_depend_on_what_shares_the_step():
    def boundaries(companions):
        pool = PagePool(60, 64)
        sched = Scheduler(pool, chunk_tokens=96, short_prompt_positions=100)
        target = req("target", 700, 1)
        sched.add(target)
        for i, n in enumerate(companions):
            sched.add(req(f"c{i}", n, 3))
        while sched.has_work:
            full_step(sched)
        return target.chunks

    alone = boundaries([])
    assert alone == [(k * 96, min(96, 700 - k * 96)) for k in range(8)]
    assert boundaries([5, 90, 300, 7]) == alone
    assert boundaries([200, 200, 33]) == alone


def test_chunk_budget_exhausted_exactly():
    _, sched = make(chunk_tokens=64)
    for rid in ("a", "b"):
        sched.add(req(rid, 64, 2))
    plan = sched.schedule()
    assert [(c.request.request_id, c.length) for c in plan.chunks] == [("a", 64)]
    assert plan.chunks[0] == Chunk(plan.chunks[0].request, 0, 64)


def test_step_kinds():
    _, sched = make(chunk_tokens=512)
    assert sched.schedule().kind == "idle"
    sched.finish_step()
    a = req("a", 10, 5)
    sched.add(a)
    plan = sched.schedule()
    assert plan.kind == "chunk-only" and not plan.decodes and not plan.empty
    advance(plan)
    sched.finish_step()
    plan = sched.schedule()
    assert plan.kind == "pure-decode" and ids(plan.decodes) == ["a"] and not plan.chunks
    assert plan.prompt_positions == 0
    advance(plan)
    sched.finish_step()
    sched.add(req("b", 20, 2))
    plan = sched.schedule()
    assert plan.kind == "loaded"
    assert ids(plan.decodes) == ["a"] and [c.request.request_id for c in plan.chunks] == ["b"]


def test_finish_step_returns_exactly_the_retired_pages_and_counts_steps():
    pool, sched = make(num_pages=5)
    a, b = req("a", 5, 1), req("b", 5, 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert pool.in_step
    pages_a = list(pool.owned["a"])
    advance(plan)
    free_mid = pool.num_free
    freed = sched.finish_step()
    assert sorted(freed) == sorted(pages_a)
    assert pool.num_free == free_mid + len(pages_a)
    assert sched.step_index == 1 and not pool.in_step
    while sched.has_work:
        full_step(sched)
    assert pool.num_free == pool.capacity and not pool.owned
    assert b.state is State.FINISHED and len(b.output) == 3


# -- cancel ---------------------------------------------------------------------------------------------------
def test_cancel_unknown():
    _, sched = make()
    res = sched.cancel("nobody", {})
    assert res == CancelResult("nobody", "unknown", 0)
    assert not res.cancelled


def test_cancel_waiting_request_leaves_the_queue_and_takes_no_pages():
    pool, sched = make(num_pages=3)
    a, b, c = req("a", 100, 20), req("b", 10, 2), req("c", 10, 2)   # a takes the whole pool
    reqs = {r.request_id: r for r in (a, b, c)}
    for r in (a, b, c):
        sched.add(r)
    sched.schedule()
    res = sched.cancel("b", reqs)
    assert res.outcome == "cancelled" and res.cancelled and res.emitted == 0
    assert b.state is State.CANCELLED
    assert ids(sched.waiting) == ["c"]
    sched.finish_step()
    assert "b" not in pool.owned
    assert sched.cancel("b", reqs).outcome == "already-cancelled"
    while sched.has_work:
        plan = full_step(sched)
        assert "b" not in ids(plan.admitted)
    assert b.output == [] and b.admit_step is None and c.state is State.FINISHED


def test_cancel_running_request_keeps_its_tokens_and_frees_its_pages_at_the_end_of_the_step():
    pool, sched = make(num_pages=5)
    a = req("a", 10, 10)
    reqs = {"a": a}
    sched.add(a)
    full_step(sched)
    full_step(sched)                                     # prompt + one decode: 2 tokens
    plan = sched.schedule()                              # mid-step cancellation
    advance(plan)
    free_mid = pool.num_free
    res = sched.cancel("a", reqs)
    assert (res.outcome, res.emitted) == ("cancelled", 3)
    assert a.state is State.CANCELLED and a.output == [0, 0, 0]
    assert pool.num_free == free_mid and "a" in pool.owned   # not during the step
    assert len(sched.finish_step()) == 1
    assert pool.num_free == pool.capacity and not sched.running and not sched.has_work
    assert sched.cancel("a", reqs) == CancelResult("a", "already-cancelled", 3)


def test_cancel_between_steps_stops_the_request_before_its_next_chunk():
    pool, sched = make(num_pages=9, chunk_tokens=64)
    a = req("a", 200, 4)
    sched.add(a)
    full_step(sched)
    assert sched.cancel("a", {"a": a}).cancelled
    plan = sched.schedule()
    assert plan.empty and plan.kind == "idle"           # no chunk for a cancelled request
    assert "a" in pool.owned                            # its pages return at the end of this step
    sched.finish_step()
    assert not pool.owned and a.num_cached == 64


def test_cancel_already_finished():
    _, sched = make()
    a = req("a", 5, 2)
    sched.add(a)
    full_step(sched)
    full_step(sched)
    assert a.state is State.FINISHED
    res = sched.cancel("a", {"a": a})
    assert (res.outcome, res.emitted, res.cancelled) == ("already-finished", 2, False)
    assert a.state is State.FINISHED


# -- prefill share: the debt ----------------------------------------------------------------------------------
def timed_step(sched, duration):
    plan = sched.schedule()
    advance(plan)
    sched.finish_step(duration=duration)
    return plan


def decoding_with_long_prompt(p, n_decoders=2, long_len=2000, chunk_tokens=128):
    pool = PagePool(200, 64)
    sched = Scheduler(pool, chunk_tokens=chunk_tokens, prefill_share=p)
    decoders = [req(f"d{i}", 4, 500) for i in range(n_decoders)]
    for r in decoders:
        sched.add(r)
    timed_step(sched, 1.0)                              # their prompts: chunk-only, nobody decoding, no debt
    long_ = req("long", long_len, 2)
    sched.add(long_)
    return sched, decoders, long_


@pytest.mark.parametrize("p", [0.0, 0.005, -0.5, 1.5, float("nan"), float("inf"), "x", None])
def test_prefill_share_out_of_range_falls_back_to_1(p):
    assert Scheduler(PagePool(4, 64), prefill_share=p).ledger.prefill_share == 1.0


def test_prefill_share_1_never_owes():
    sched, _, long_ = decoding_with_long_prompt(1.0)
    for _ in range(5):
        plan = timed_step(sched, 10.0)
        assert plan.long_chunks == 1 and plan.withheld == 0
        assert sched.ledger.debt == 0.0
    assert sched.withheld_steps == 0


def test_debt_withholds_long_pieces_for_pure_decode_steps():
    sched, decoders, long_ = decoding_with_long_prompt(0.5)
    plan = timed_step(sched, 1.0)                       # a pure decode step teaches the estimate: 1 s
    assert plan.kind == "loaded" and plan.long_chunks == 1   # (the first long piece: debt 0 so far)
    # no estimate yet when that loaded step ran: its whole second counts as extra
    assert sched.ledger.debt == pytest.approx(1.0)
    plan = timed_step(sched, 1.0)
    assert plan.kind == "pure-decode" and plan.withheld == 1 and sched.ledger.decode_estimate == 1.0
    assert sched.ledger.debt == 0.0
    plan = timed_step(sched, 4.0)                       # loaded: 3 s beyond a decode step, owes 3 (1 - p) / p = 3
    assert plan.long_chunks == 1 and sched.ledger.debt == pytest.approx(3.0)
    kinds = [timed_step(sched, 1.0).kind for _ in range(4)]
    assert kinds == ["pure-decode"] * 3 + ["loaded"]
    assert sched.withheld_steps == 4


def test_debt_saturates():
    sched, _, _ = decoding_with_long_prompt(0.01)
    plan = timed_step(sched, 0.5)                       # loaded: owes 0.5 * 99 = 49.5 s, capped at max(1, 8 * 0.5)
    assert plan.long_chunks == 1 and sched.ledger.debt == pytest.approx(4.0)
    n = 0
    while timed_step(sched, 0.01).kind == "pure-decode":
        n += 1
    assert n == 400                                     # 4 s of 10 ms decode steps, then the next long piece
    timed_step(sched, 0.05)                             # a fast loaded step owes 3.96 s: the cap is 1 s
    assert sched.ledger.debt == pytest.approx(1.0)


def test_debt_counts_only_runnable_decoders():
    sched, decoders, long_ = decoding_with_long_prompt(0.25, n_decoders=1)
    timed_step(sched, 5.0)
    assert sched.ledger.debt > 0
    sched.cancel("d0", {"d0": decoders[0]})             # the only decoder goes: nobody is owed anything
    plan = timed_step(sched, 0.1)
    assert plan.kind == "chunk-only" and plan.long_chunks == 1 and sched.ledger.debt == 0.0
    timed_step(sched, 5.0)                              # long work with nobody decoding owes nothing
    assert sched.ledger.debt == 0.0


def test_short_prompts_never_wait_for_the_debt():
    sched, _, long_ = decoding_with_long_prompt(0.25)
    timed_step(sched, 1.0)
    timed_step(sched, 1.0)
    timed_step(sched, 1.0)
    assert sched.ledger.debt == pytest.approx(1.0) and sched.ledger.decode_estimate == 1.0
    chat = req("chat", 100, 3)
    sched.add(chat)
    plan = timed_step(sched, 1.2)
    assert chunks(plan) == [("chat", 0, 100)] and plan.withheld == 1 and plan.long_chunks == 0
    assert sched.ledger.debt == 0.0        # decode tokens + a short piece pay the decode part: min(1.2, 1.0)


@pytest.mark.parametrize("last_step, debt_after", [(4.0, 0.0), (6.0, 2.0), (2.0, 0.0)])
def test_last_long_piece_pays_its_debt_ahead(last_step, debt_after):
    """778 positions at chunk 128: long pieces at 0, 128, 256 (after 256..384, 394 are left: short), so the piece at
    256 is the last long one. It owes its debt ahead, estimated from the piece before it (3 s beyond a decode step),
    and settles the rest after it runs: none if it cost what was estimated (or less: no credit), 2 s if 2 s more."""
    sched, decoders, long_ = decoding_with_long_prompt(0.5, long_len=512 + 2 * 128 + 10)
    timed_step(sched, 1.0)                              # first long piece: no estimate yet, owes 1 s
    timed_step(sched, 1.0)                              # paid by a pure decode step; the estimate is 1 s
    plan = timed_step(sched, 4.0)                       # second long piece: owes 3 s, its extra is the estimate
    assert chunks(plan) == [("long", 128, 128)] and sched.ledger.debt == pytest.approx(3.0)
    kinds = [timed_step(sched, 1.0).kind for _ in range(6)]
    # its own 3 s, then the last long piece's 3 s ahead: 6 pure decode steps before it
    assert kinds == ["pure-decode"] * 6 and sched.ledger.prepaid == {"long": pytest.approx(3.0)}
    plan = timed_step(sched, last_step)
    assert chunks(plan) == [("long", 256, 128)] and plan.long_chunks == 1
    assert sched.ledger.debt == pytest.approx(debt_after)
    plan = timed_step(sched, 1.0)                       # the short tail never waits
    assert chunks(plan) == [("long", 384, 128)] and plan.long_chunks == 0


def test_a_single_long_piece_has_no_estimate_and_does_not_wait():
    sched, decoders, long_ = decoding_with_long_prompt(0.5, long_len=600)   # one long piece, then 472: short
    plan = sched.schedule()
    assert plan.long_chunks == 1 and plan.withheld == 0 and sched.ledger.prepaid == {"long": 0.0}
    advance(plan)
    sched.finish_step(duration=3.0)
    assert sched.ledger.debt == pytest.approx(3.0) and sched.ledger.prepaid == {}   # owed after it, as for any long piece


def test_a_cancelled_prompt_gives_back_the_debt_it_charged_ahead():
    sched, decoders, long_ = decoding_with_long_prompt(0.5, long_len=512 + 2 * 128 + 10)
    timed_step(sched, 1.0)
    timed_step(sched, 1.0)
    timed_step(sched, 4.0)                              # owes 3 s; the last long piece is next
    plan = timed_step(sched, 1.0)                       # withheld: charges 3 s ahead, pays 1
    assert plan.withheld == 1 and sched.ledger.debt == pytest.approx(5.0) and sched.ledger.prepaid == {"long": 3.0}
    sched.cancel("long", {"long": long_})
    timed_step(sched, 1.0)                              # the long prompt retires at the end of this step
    assert sched.ledger.prepaid == {} and sched.ledger.debt == pytest.approx(1.0)   # 5 - 1 paid - 3 given back
