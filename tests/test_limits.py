"""The last untyped inputs (issue 34): construction checks that need the model (record_topk against the vocabulary,
num_pages against the memory it asks for, tp against the heads, a backend this device cannot run), all ConfigError
subclasses raised before anything is allocated; and Engine.score() validating its tokens as submit() does and
refusing, typed, a pool without room now, also from a thread beside serving."""
from __future__ import annotations

import threading

import pytest
import torch

import kernels
from engine import (ConfigError, EmptyPromptError, Engine, EngineConfig, ExceedsMaxPositionsError, NeverFitsError,
                    NoRoomError, PoolTooLargeError, RequestError, TokenOutOfVocabError)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = EngineConfig(chunk_tokens=128, num_pages=9)      # 8 pages of 64 slots
PROMPT = [5, 17, 300, 42, 1000, 7, 7, 3]


# -- construction --------------------------------------------------------------------------------------------------
def test_record_topk_beyond_the_vocabulary_is_refused(loaded):
    vocab = loaded[0].shape.vocab_size
    with pytest.raises(ConfigError, match=rf"^record_topk=5000: more than the {vocab} tokens of the model's "
                                          rf"vocabulary$"):
        Engine(EngineConfig(record_topk=5000, num_pages=9), loaded=loaded)
    e = Engine(EngineConfig(record_topk=vocab, num_pages=9), loaded=loaded)     # the whole vocabulary is fine
    e.submit(PROMPT, 1, request_id="a")
    e.step()
    assert len(e.topk["a"][0][0]) == vocab


def test_a_pool_larger_than_the_memory_is_refused_before_allocating(loaded):
    # 10**8 pages of the small model's 64 slots: terabytes; main built a 4.3 GB free list before torch failed
    with pytest.raises(PoolTooLargeError, match=r"^num_pages=100000000: 100000000 pages of 64 slots take [\d.e+]+ GiB "
                                                r"of KV cache on this model \(\d+ bytes a page\), more than the "
                                                r"[\d.]+ GiB free on cpu") as info:
        Engine(EngineConfig(num_pages=10**8), loaded=loaded)
    assert isinstance(info.value, ConfigError)
    with pytest.raises(PoolTooLargeError, match=r"^kv_cache_bytes=\d+: "):      # a budget sized beyond the machine
        Engine(EngineConfig(kv_cache_bytes=1 << 60, max_batch=1 << 20), loaded=loaded)


def test_tp_that_does_not_divide_the_heads_is_a_config_error(loaded):
    with pytest.raises(ConfigError, match=r"tp=3 cannot shard this model: 4 attention heads do not split over 3 "
                                          r"ranks"):
        Engine(EngineConfig(tp=3), loaded=loaded)


def test_a_backend_that_cannot_run_here_is_a_config_error(loaded):
    assert issubclass(kernels.Unavailable, ConfigError) and issubclass(kernels.Unavailable, ValueError)
    if torch.cuda.is_available():
        pytest.skip("flash may run here; the CPU case is what this checks")
    with pytest.raises(ConfigError, match=r"attention backend 'flash' cannot run here: flash-attn needs a CUDA "
                                          r"device") as info:
        Engine(EngineConfig(backend="flash", page_size=256, num_pages=9), loaded=loaded)
    assert isinstance(info.value, kernels.Unavailable)


# -- score() -------------------------------------------------------------------------------------------------------
def serving(loaded) -> Engine:
    """An engine with two requests that hold 7 of its 8 pages."""
    e = Engine(CONFIG, loaded=loaded)
    e.submit([1] * 250, 6, request_id="a")      # 4 pages
    e.submit([2] * 150, 6, request_id="b")      # 3 pages
    e.step()
    assert e.pool.num_free == 1
    return e


BAD_SCORES = {
    "empty": ([], EmptyPromptError, "^score: empty prompt$"),
    "minus-one": ([5, -1], TokenOutOfVocabError, r"^score: prompt\[1\] = -1 is outside the vocabulary \[0, 4096\)$"),
    "vocab-size": ([4096], TokenOutOfVocabError, r"^score: prompt\[0\] = 4096 is outside the vocabulary"),
    "too-long": ([1] * 8193, ExceedsMaxPositionsError, r"^score: 8193 positions exceed the max positions served "
                                                       r"\(8192; the model's: 8192\)$"),
    "never-fits": ([1] * 513, NeverFitsError, r"^score: needs 9 pages of 64 slots .* the whole pool holds 8"),
    "no-room": ([1] * 65, NoRoomError, r"^score: 65 positions need 2 pages of 64 slots, 1 of 8 are free now"),
}


@pytest.mark.parametrize("name", sorted(BAD_SCORES))
def test_bad_score_is_refused_typed_and_serving_goes_on(name, loaded):
    tokens, error, match = BAD_SCORES[name]
    clean = serving(loaded)
    while clean.scheduler.has_work:
        clean.step()
    e = serving(loaded)
    before = (e.pool.num_free, dict(e.pool.owned), e.scheduler.step_index)
    with pytest.raises(error, match=match) as info:
        e.score(tokens)
    assert isinstance(info.value, RequestError)
    assert (e.pool.num_free, dict(e.pool.owned), e.scheduler.step_index) == before
    while e.scheduler.has_work:
        e.step()
    assert {k: r.tokens for k, r in e.results().items()} == {k: r.tokens for k, r in clean.results().items()}
    assert e.pool.num_free == e.pool.capacity
    e.score([1] * 64)        # with the pages back, a score that fits runs


def test_score_from_a_thread_beside_serving_is_typed(loaded):
    """Main raised PoolInvariantError (the error of our own bugs) in 5 of 6 such runs. Now a score either runs,
    with the logits of an idle engine, or is refused with NoRoomError; serving is unchanged."""
    tokens = [3] * 200                                   # 4 pages: room only while few requests hold pages
    want = Engine(CONFIG, loaded=loaded).score(tokens)
    clean = Engine(CONFIG, loaded=loaded)
    specs = [([i + 10] * (40 + 30 * (i % 5)), 4 + i % 3) for i in range(12)]
    for i, (p, b) in enumerate(specs):
        clean.submit(p, b, request_id=f"r{i}")
    clean.run()
    e = Engine(CONFIG, loaded=loaded)
    outcomes, failures, stop = [], [], threading.Event()

    def scorer():
        while not stop.is_set():
            try:
                outcomes.append(torch.equal(e.score(tokens), want))
            except NoRoomError:
                outcomes.append("no room")
            except BaseException as ex:     # anything else fails the test
                failures.append(f"{type(ex).__name__}: {ex}")
                return

    t = threading.Thread(target=scorer)
    t.start()
    try:
        for i, (p, b) in enumerate(specs):
            e.submit(p, b, request_id=f"r{i}")
        e.run()
    finally:
        stop.set()
        t.join()
    assert not failures, failures
    # which of the two a score meets depends on the threads' timing; never another error, never other logits
    # (a score refused for room: tests/test_limits.py's full-pool case, deterministic)
    assert outcomes and set(outcomes) <= {True, "no room"}, outcomes
    assert {k: r.tokens for k, r in e.results().items()} == {k: r.tokens for k, r in clean.results().items()}
    e.pool.check()
    assert e.pool.num_free == e.pool.capacity
