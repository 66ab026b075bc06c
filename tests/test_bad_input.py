"""Bad input through engine.Engine on the small model: each bad request raises its typed error at submit, nothing
in the engine changes, and the engine then serves the other requests to completion with exactly the tokens of a run
that never saw the bad request."""
from __future__ import annotations

import pytest
import torch

from engine import (BadBudgetError, BadPromptError, DuplicateRequestIdError, EmptyPromptError, Engine, EngineConfig,
                    ExceedsMaxPositionsError, NeverFitsError, RequestError, TokenOutOfVocabError)
from engine.loader import load_model

CONFIG = EngineConfig(chunk_tokens=128, num_pages=9)      # 8 pages of 64 slots: 512 slots in all
A = ([5, 17, 300, 42, 1000, 7, 7, 3], 4)
B = ([2000, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], 3)
C = ([99, 98, 97, 96], 3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The forwards here are tiny; on a shared 2-core machine torch's second intra-op thread makes each step up to
    ~100x slower (spinning against other processes). One thread for this module, restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, torch.float32, "cpu")


@pytest.fixture(scope="module")
def shape(loaded):
    return loaded[0].shape


def snapshot(e: Engine):
    return (sorted(e.requests), [r.request_id for r in e.scheduler.waiting],
            [r.request_id for r in e.scheduler.running], e.pool.num_free, {k: list(v) for k, v in e.pool.owned.items()},
            e.scheduler.next_arrival, e.scheduler.step_index, [list(r.prompt) for r in e.requests.values()])


def run_bounded(e: Engine, max_steps: int = 200):
    """Engine.run, but a request that can never be admitted fails the test instead of hanging it."""
    for _ in range(max_steps):
        if not e.scheduler.has_work:
            return e.results()
        e.step()
    raise AssertionError(f"still working after {max_steps} steps: waiting "
                         f"{[r.request_id for r in e.scheduler.waiting]}, running "
                         f"{[r.request_id for r in e.scheduler.running]}, {e.pool.num_free} pages free (a hang)")


def serve(loaded, bad=None):
    """Submit A and B, run two steps, try the bad request (if any), submit C, run to completion."""
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*A, request_id="a")
    e.submit(*B, request_id="b")
    e.step()
    e.step()
    if bad is not None:
        error, match, kwargs = bad
        before = snapshot(e)
        with pytest.raises(error, match=match) as info:
            e.submit(**kwargs)
        assert isinstance(info.value, RequestError) and isinstance(info.value, ValueError)
        assert snapshot(e) == before, "a refused request changed the engine"
    e.submit(*C, request_id="c")
    results = run_bounded(e)
    assert e.pool.num_free == e.pool.capacity and not e.pool.owned
    return results


@pytest.fixture(scope="module")
def reference(loaded):
    results = serve(loaded)
    assert sorted(results) == ["a", "b", "c"]
    assert [len(results[k].tokens) for k in "abc"] == [A[1], B[1], C[1]]
    return {k: r.tokens for k, r in results.items()}


def BAD(shape):
    v, maxpos = shape.vocab_size, shape.max_positions
    return {
        "empty-prompt": (EmptyPromptError, "empty prompt", dict(prompt=[], budget=3)),
        "token-minus-one": (TokenOutOfVocabError, r"prompt\[1\] = -1 is outside the vocabulary \[0, 4096\)",
                            dict(prompt=[5, -1, 6], budget=3)),
        "token-vocab-size": (TokenOutOfVocabError, rf"prompt\[0\] = {v} is outside the vocabulary",
                             dict(prompt=[v], budget=3)),
        "token-not-an-id": (BadPromptError, r"prompt\[1\] = 2.5 \(float\) is not a token id",
                            dict(prompt=[5, 2.5], budget=3)),
        "exceeds-max-positions": (ExceedsMaxPositionsError, rf"= {maxpos + 1} exceeds the max positions served",
                                  dict(prompt=[1] * maxpos, budget=1)),
        "budget-zero": (BadBudgetError, "integer >= 1, got 0", dict(prompt=[5], budget=0)),
        "budget-negative": (BadBudgetError, "integer >= 1, got -3", dict(prompt=[5], budget=-3)),
        "budget-float": (BadBudgetError, "integer >= 1, got 2.5", dict(prompt=[5], budget=2.5)),
        "budget-bool": (BadBudgetError, "integer >= 1, got True", dict(prompt=[5], budget=True)),
        "never-fits": (NeverFitsError, r"needs 9 pages of 64 slots .* whole pool holds 8: it could never be admitted",
                       dict(prompt=[1] * 500, budget=13)),
        "duplicate-id-running": (DuplicateRequestIdError, "'a' is already in use",
                                 dict(prompt=[9, 9, 9], budget=2, request_id="a")),
    }


BAD_NAMES = ["empty-prompt", "token-minus-one", "token-vocab-size", "token-not-an-id", "exceeds-max-positions",
             "budget-zero", "budget-negative", "budget-float", "budget-bool", "never-fits", "duplicate-id-running"]


def test_bad_cases_listed(shape):
    assert sorted(BAD(shape)) == sorted(BAD_NAMES)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_request_is_refused_and_the_engine_keeps_serving(name, loaded, shape, reference):
    results = serve(loaded, BAD(shape)[name])
    assert sorted(results) == ["a", "b", "c"]
    assert {k: r.tokens for k, r in results.items()} == reference
    assert all(r.state == "finished" for r in results.values())
    assert results["a"].prompt == A[0]          # a duplicate id did not overwrite the original


def test_a_request_exactly_the_size_of_the_pool_is_accepted_and_served(loaded):
    e = Engine(CONFIG, loaded=loaded)
    e.submit([1] * 510, 2, request_id="whole-pool")      # 512 slots = 8 pages: the whole pool
    e.submit(*C, request_id="c")                           # waits behind it (strict FCFS)
    results = run_bounded(e)
    assert [len(results[k].tokens) for k in ("whole-pool", "c")] == [2, C[1]]
    assert e.pool.num_free == e.pool.capacity


def test_duplicate_id_of_a_finished_request(loaded):
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*C, request_id="c")
    run_bounded(e)
    with pytest.raises(DuplicateRequestIdError, match="'c' is already in use"):
        e.submit([1, 2], 1, request_id="c")
    assert e.results()["c"].prompt == C[0]


def test_duplicate_non_str_id_is_refused(loaded):
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*C, request_id=7)
    with pytest.raises(DuplicateRequestIdError):
        e.submit([1, 2], 1, request_id=7)
    assert [r.request_id for r in e.scheduler.waiting] == ["7"]
