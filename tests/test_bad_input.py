"""Bad input through engine.Engine on the small model: each bad request raises its typed error at submit, nothing
in the engine changes, and the engine then serves the other requests to completion with exactly the tokens of a run
that never saw the bad request."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import (BadArrivalTimeError, BadBudgetError, BadPromptError, BadRequestIdError, DuplicateRequestIdError, EmptyPromptError, Engine, EngineConfig,
                    ExceedsMaxPositionsError, NeverFitsError, RequestError, TokenOutOfVocabError)
from gates.traffic import snapshot     # what a refused call must leave as it was (the request gate's own)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = EngineConfig(chunk_tokens=128, num_pages=9)      # 8 pages of 64 slots: 512 slots in all
A = ([5, 17, 300, 42, 1000, 7, 7, 3], 4)
B = ([2000, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], 3)
C = ([99, 98, 97, 96], 3)


@pytest.fixture(scope="module")
def shape(loaded):
    return loaded[0].shape


def run_bounded(e: Engine, max_steps: int = 200):
    """Engine.run, but a request that can never be admitted fails the test instead of hanging it."""
    for _ in range(max_steps):
        if not e.scheduler.has_work:
            return e.results()
        e.step()
    raise AssertionError(f"still working after {max_steps} steps: waiting "
                         f"{[r.request_id for r in e.scheduler.waiting]}, running "
                         f"{[r.request_id for r in e.scheduler.running]}, {e.pool.num_free} pages free (a hang)")


def serve(loaded, bad=None, c_form=list):
    """Submit A and B, run two steps, try the bad request (if any), submit C (its prompt as `c_form` gives it), run
    to completion."""
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*A, request_id="a")
    e.submit(*B, request_id="b")
    e.step()
    e.step()
    e.submit([40, 41], 1, request_id="7")     # a short request beside the batch, finished before the bad one
    e.step()
    if bad is not None:
        error, match, kwargs = bad
        before = snapshot(e)
        with pytest.raises(error, match=match) as info:
            e.submit(**kwargs)
        assert isinstance(info.value, RequestError) and isinstance(info.value, ValueError)
        assert snapshot(e) == before, "a refused request changed the engine"
    e.submit(c_form(C[0]), C[1], request_id="c")
    results = run_bounded(e)
    assert e.pool.num_free == e.pool.capacity and not e.pool.owned
    return results


@pytest.fixture(scope="module")
def reference(loaded):
    results = serve(loaded)
    assert sorted(results) == ["7", "a", "b", "c"]
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
        # issue 16: every other bad input, refused with the position and the type
        "float-tensor": (BadPromptError, r"prompt\[0\] = 5\.69\d* \(float\) is not a token id: token ids are "
                         r"integers \(the prompt is a torch\.Tensor of dtype torch\.float32\)",
                         dict(prompt=torch.tensor([5.7, 17.9]), budget=3)),
        "float-array": (BadPromptError, r"prompt\[0\] = 1\.0 \(float\) .*numpy\.ndarray of dtype float64",
                        dict(prompt=np.array([1.0, 2.5]), budget=3)),
        "numpy-float-item": (BadPromptError, r"prompt\[0\] = np\.float64\(3\.0\) \(numpy\.float64\)",
                             dict(prompt=[np.float64(3.0)], budget=3)),
        "bool-item": (BadPromptError, r"prompt\[1\] = True \(bool\) is not a token id",
                      dict(prompt=[5, True], budget=3)),
        "bool-tensor": (BadPromptError, r"prompt\[0\] = True \(bool\)", dict(prompt=torch.tensor([True]), budget=3)),
        "bytes": (BadPromptError, r"prompt is bytes, not token ids \(bytes\)", dict(prompt=b"abc", budget=3)),
        "text": (BadPromptError, r"prompt is text, not token ids \(str\)", dict(prompt="hello", budget=3)),
        "mapping": (BadPromptError, r"prompt is a mapping .*\(dict\)", dict(prompt={5: 1, 6: 2}, budget=3)),
        "set": (BadPromptError, r"prompt is a set \(it has no order\)", dict(prompt={5, 6}, budget=3)),
        "2d-array": (BadPromptError, r"prompt is a 2-dimensional numpy\.ndarray of shape \(2, 2\)",
                     dict(prompt=np.array([[5, 6], [7, 8]]), budget=3)),
        "2d-tensor": (BadPromptError, r"prompt is a 2-dimensional torch\.Tensor of shape \(1, 3\)",
                      dict(prompt=torch.tensor([[5, 6, 7]]), budget=3)),
        "0d-array": (BadPromptError, r"prompt is a 0-dimensional numpy\.ndarray of shape \(\)",
                     dict(prompt=np.array(5), budget=3)),
        "not-iterable": (BadPromptError, "prompt must be a sequence of token ids, got NoneType",
                         dict(prompt=None, budget=3)),
        "budget-str": (BadBudgetError, "integer >= 1, got '3'", dict(prompt=[5], budget="3")),
        "budget-numpy-bool": (BadBudgetError, "integer >= 1, got (np\\.)?True", dict(prompt=[5], budget=np.bool_(True))),
        "id-empty": (BadRequestIdError, "non-empty string or an integer, got '' \\(str\\)",
                     dict(prompt=[5], budget=3, request_id="")),
        "id-float": (BadRequestIdError, r"got 3\.5 \(float\)", dict(prompt=[5], budget=3, request_id=3.5)),
        "id-bool": (BadRequestIdError, r"got True \(bool\)", dict(prompt=[5], budget=3, request_id=True)),
        "id-tuple": (BadRequestIdError, r"got \('score',\) \(tuple\)",
                     dict(prompt=[5], budget=3, request_id=("score",))),
        "duplicate-id-int-of-str": (DuplicateRequestIdError, "'7' is already in use",
                                    dict(prompt=[5], budget=3, request_id=7)),
        "arrival-str": (BadArrivalTimeError, r"arrival_time must be a finite number .* got 'soon' \(str\)",
                        dict(prompt=[5], budget=3, arrival_time="soon")),
        "arrival-nan": (BadArrivalTimeError, "got nan", dict(prompt=[5], budget=3, arrival_time=float("nan"))),
        "arrival-inf": (BadArrivalTimeError, "got inf", dict(prompt=[5], budget=3, arrival_time=float("inf"))),
        "arrival-bool": (BadArrivalTimeError, r"got True \(bool\)", dict(prompt=[5], budget=3, arrival_time=True)),
    }


BAD_NAMES = ["empty-prompt", "token-minus-one", "token-vocab-size", "token-not-an-id", "exceeds-max-positions",
             "budget-zero", "budget-negative", "budget-float", "budget-bool", "never-fits", "duplicate-id-running",
             "float-tensor", "float-array", "numpy-float-item", "bool-item", "bool-tensor", "bytes", "text", "mapping",
             "set", "2d-array", "2d-tensor", "0d-array", "not-iterable", "budget-str", "budget-numpy-bool", "id-empty",
             "id-float", "id-bool", "id-tuple", "duplicate-id-int-of-str", "arrival-str", "arrival-nan",
             "arrival-inf", "arrival-bool"]


def test_bad_cases_listed(shape):
    assert sorted(BAD(shape)) == sorted(BAD_NAMES)


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_request_is_refused_and_the_engine_keeps_serving(name, loaded, shape, reference):
    results = serve(loaded, BAD(shape)[name])
    assert sorted(results) == ["7", "a", "b", "c"]
    assert {k: r.tokens for k, r in results.items()} == reference
    assert all(r.state == "finished" for r in results.values())
    assert results["a"].prompt == A[0]          # a duplicate id did not overwrite the original


# Every accepted form of a prompt: read once (a generator too) and stored as a list of ints.
GOOD_FORMS = {
    "generator": lambda p: (t for t in p),
    "iterator": iter,
    "tuple": tuple,
    "numpy-int64": np.array,
    "numpy-uint16": lambda p: np.array(p, dtype=np.uint16),
    "numpy-items": lambda p: [np.int32(t) for t in p],
    "torch-int64": torch.tensor,
    "torch-int32": lambda p: torch.tensor(p, dtype=torch.int32),
    "tensor-items": lambda p: list(torch.tensor(p)),
}


@pytest.mark.parametrize("form", sorted(GOOD_FORMS))
def test_every_prompt_form_is_read_once_and_served_beside_the_batch(form, loaded, reference):
    results = serve(loaded, c_form=GOOD_FORMS[form])
    assert results["c"].prompt == C[0] and all(type(t) is int for t in results["c"].prompt)
    assert {k: r.tokens for k, r in results.items()} == reference


def test_a_generator_prompt_alone_drains(loaded, reference):
    """On main a generator was consumed by validation: the request was stored with an empty prompt, every step
    raised and it never drained."""
    e = Engine(CONFIG, loaded=loaded)
    e.submit((t for t in C[0]), C[1], request_id="c")
    results = run_bounded(e)
    assert results["c"].prompt == C[0] and results["c"].tokens == reference["c"]
    assert e.pool.num_free == e.pool.capacity


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
