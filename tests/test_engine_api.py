"""The engine's API on the small model (issue 16): results taken and released (pop_result) with the id reusable,
bounded traces and top-k records, scoring beside requests whose ids look like its own, and EngineConfig refusing
every bad field with the field and the value named."""
from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from engine import (ConfigError, Engine, EngineConfig, RequestError, RequestNotDoneError, UnknownRequestError)
from engine.config import device_problem

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = EngineConfig(chunk_tokens=128, num_pages=9, record_topk=2)
A = ([5, 17, 300, 42, 1000, 7, 7, 3], 4)
B = ([2000, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], 6)


def drain(e: Engine, max_steps: int = 200) -> None:
    for _ in range(max_steps):
        if not e.scheduler.has_work:
            return
        e.step()
    raise AssertionError(f"still working after {max_steps} steps")


@pytest.fixture(scope="module")
def clean(loaded):
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*A, request_id="a")
    e.submit(*B, request_id="b")
    drain(e)
    return e.results(), dict(e.topk)


# -- pop_result ----------------------------------------------------------------------------------------------------
def test_pop_result_takes_the_result_and_releases_the_id(loaded, clean):
    results, topk = clean
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*A, request_id="a")
    e.submit(*B, request_id="b")
    drain(e)
    before = e.results()["a"]
    got = e.pop_result("a")
    assert got == before and got.tokens == results["a"].tokens
    assert "a" not in e.requests and "a" not in e.topk and "a" not in e.results()
    assert e.topk["b"] == topk["b"]                       # the other request's records are untouched
    with pytest.raises(UnknownRequestError, match="no request 'a'"):
        e.pop_result("a")
    e.submit(*A, request_id="a")                          # the id is free again, and serves as before
    drain(e)
    assert e.results()["a"].tokens == results["a"].tokens
    # served alone now, not beside b: the same top-k ids, logits equal up to the batch's rounding
    assert [ids for ids, _ in e.topk["a"]] == [ids for ids, _ in topk["a"]]


def test_pop_result_refuses_a_request_not_done(loaded):
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*A, request_id="a")
    e.submit(*B, request_id=3)
    with pytest.raises(RequestNotDoneError, match="a is waiting: its result is not final yet"):
        e.pop_result("a")
    e.step()
    with pytest.raises(RequestNotDoneError, match="3 is decode"):
        e.pop_result(3)                                   # an int id names the same request as "3"
    assert e.cancel(3).cancelled
    with pytest.raises(RequestNotDoneError, match="3 is cancelled and holds its pages until the end of the step"):
        e.pop_result("3")
    owned = dict(e.pool.owned)
    assert "3" in owned, "the cancelled request keeps its pages until the end of the next step"
    e.step()
    assert "3" not in e.pool.owned
    assert e.pop_result("3").state == "cancelled"
    with pytest.raises(UnknownRequestError) as info:
        e.pop_result("zzz")
    assert isinstance(info.value, KeyError) and isinstance(info.value, RequestError)
    drain(e)
    assert e.pop_result("a").state == "finished" and not e.requests and e.pool.num_free == e.pool.capacity


def test_trace_limit_keeps_the_last_steps(loaded):
    e = Engine(CONFIG.with_(trace_limit=3), loaded=loaded)
    e.submit(*B, request_id="b")
    drain(e)
    assert len(e.trace) == 3 and [s.index for s in e.trace] == [3, 4, 5]   # 6 steps, one token each
    full = Engine(CONFIG, loaded=loaded)
    full.submit(*B, request_id="b")
    drain(full)
    assert [s.index for s in full.trace] == list(range(6))


# -- scoring beside requests ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("rid", ["__score__5", "score", "('score',)"])
def test_scoring_beside_a_request_named_like_its_owner(rid, loaded, clean):
    """Engine.score reserved pages under `__score__{len}`; a request with that id broke it. Its owner is now a key no
    request id can be."""
    results, _ = clean
    ref = Engine(CONFIG, loaded=loaded).score(A[0][:5])
    e = Engine(CONFIG, loaded=loaded)
    e.submit(*A, request_id=rid)
    e.step()
    assert rid in e.pool.owned
    logits = e.score(A[0][:5])                           # 5 tokens: the old owner name was __score__5
    assert torch.equal(logits, ref)
    drain(e)
    assert e.results()[rid].tokens == results["a"].tokens
    e.pool.check()
    assert e.pool.num_free == e.pool.capacity


# -- EngineConfig ----------------------------------------------------------------------------------------------
BAD_CONFIGS = [
    (dict(page_size=0), "page_size=0: must be an integer >= 1"),
    (dict(page_size=2.0), "page_size=2.0: must be an integer >= 1"),
    (dict(max_batch=-1), "max_batch=-1: must be an integer >= 1"),
    (dict(chunk_tokens=0), "chunk_tokens=0: must be an integer >= 1"),
    (dict(num_pages=1), r"num_pages=1: must be an integer >= 2 \(or None"),
    (dict(kv_cache_bytes=0), "kv_cache_bytes=0: must be an integer >= 1"),
    (dict(max_model_len=-5), r"max_model_len=-5: must be an integer >= 1 \(or None: the model's max positions\)"),
    (dict(record_topk=-1), "record_topk=-1: must be an integer >= 0"),
    (dict(short_prompt_positions=-1), "short_prompt_positions=-1: must be an integer >= 0"),
    (dict(trace_limit=0), "trace_limit=0: must be an integer >= 1"),
    (dict(tp=0), "tp=0: must be an integer >= 1"),
    (dict(tp=True), "tp=True: must be an integer >= 1"),
    (dict(tp_timeout=0), "tp_timeout=0: must be a finite number of seconds > 0"),
    (dict(tp_timeout=float("inf")), "tp_timeout=inf: must be a finite"),
    (dict(forward="fast"), "forward='fast': must be one of 'chunked', 'fused'"),
    (dict(backend="cuda"), "backend='cuda': must be one of 'torch', 'flex', 'flash'"),
    (dict(dtype="f16"), r"dtype='f16': unknown dtype 'f16'; known: \['bf16'"),
    (dict(device="gpu"), "device='gpu': unknown device; known: cpu, cuda, cuda:N"),
    (dict(prefill_share="half"), "prefill_share='half': must be a real number"),
    (dict(poison=1), "poison=1: must be True or False"),
    (dict(cuda_graphs="off"), r"cuda_graphs='off': must be True or False \(or None: automatic\)"),
    (dict(progress=None), "progress=None: must be True or False"),
    (dict(prefix_cache="yes"), "prefix_cache='yes': must be True or False"),
    (dict(capture_graphs=None), "capture_graphs=None: must be True or False"),
]


@pytest.mark.parametrize("kw, message", BAD_CONFIGS, ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))
                                                        for k, _ in BAD_CONFIGS])
def test_a_bad_config_field_is_refused_naming_it(kw, message):
    with pytest.raises(ConfigError, match=message) as info:
        EngineConfig(**kw)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match=message):        # with_() checks as well
        EngineConfig().with_(**kw)


@pytest.mark.parametrize("name", [f.name for f in fields(EngineConfig)])
def test_every_field_is_checked(name):
    # a field added without a check in __post_init__ would take any value: this catches it
    with pytest.raises(ConfigError, match=rf"^{name}=<object object at"):
        EngineConfig(**{name: object()})


def test_cuda_without_a_gpu_is_a_config_error(monkeypatch):
    import engine.config as config
    monkeypatch.setattr(config, "cuda_devices", lambda: 0)
    with pytest.raises(ConfigError, match=r"device='cuda': torch .* sees no CUDA device"):
        EngineConfig(device="cuda")
    monkeypatch.setattr(config, "cuda_devices", lambda: 2)
    assert EngineConfig(device="cuda:1").device == "cuda:1"
    with pytest.raises(ConfigError, match=r"device='cuda:2': torch sees 2 CUDA device\(s\): cuda:0 to cuda:1"):
        EngineConfig(device="cuda:2")
    assert device_problem("cuda", count=0) and device_problem("cpu") is None


def test_good_configs_still_build():
    import numpy as np
    c = EngineConfig(page_size=np.int64(256), dtype="fp16", prefill_share=float("nan"), num_pages=2,
                     max_model_len=1, trace_limit=1, compile_warmup=None)
    assert c.page_size == 256 and c.dtype == "fp16"


def test_a_pool_that_cannot_hold_one_longest_request_is_refused_at_construction(loaded):
    with pytest.raises(ConfigError, match=r"max_model_len=1024: one request of 1024 positions needs 16 pages of 64 "
                                          r"slots, but the pool holds 8 \(num_pages=9"):
        Engine(EngineConfig(num_pages=9, max_model_len=1024), loaded=loaded)
    Engine(EngineConfig(num_pages=9, max_model_len=512), loaded=loaded)          # 8 pages of 64: exactly one
    with pytest.raises(ConfigError, match=r"kv_cache_bytes=1000: a page of 64 slots takes \d+ bytes on this model, "
                                          r"and the pool needs at least 2 pages"):
        Engine(EngineConfig(kv_cache_bytes=1000), loaded=loaded)


# -- the garbage collector during a run ----------------------------------------------------------------------------
class Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""
    def __init__(self):
        self.me = self


def test_a_run_freezes_what_was_alive_before_it_and_thaws_after(loaded):
    import gc
    import weakref
    from engine.heap import gc_frozen
    assert gc.get_freeze_count() == 0
    before = Cycle()
    seen = []

    def on_step(rec):
        if not seen:
            made = Cycle()                         # garbage made during the run is still collected during it
            dead = weakref.ref(made)
            del made
            gc.collect()
            # frozen objects are in no generation: the collector does not walk them
            seen.append((gc.get_freeze_count(), any(o is before for o in gc.get_objects()), dead() is None))
    e = Engine(CONFIG, loaded=loaded)
    e.run([_spec("g", *A)], progress=on_step)
    frozen, walked, collected = seen[0]
    assert frozen > 0 and not walked and collected
    assert gc.get_freeze_count() == 0              # thawed: what died during the run can be collected now
    gone = weakref.ref(before)
    del before
    gc.collect()
    assert gone() is None
    with gc_frozen():                              # nested blocks share one freeze; the last to leave thaws
        with gc_frozen():
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0


def test_a_process_that_froze_objects_itself_keeps_its_freeze(loaded, monkeypatch):
    """The run neither thaws nor re-freezes a freeze the process made itself. (Not the freeze count: a frozen
    object that dies by its reference count, as a replaced cache entry does, leaves the permanent generation.)"""
    import gc
    gc.freeze()
    calls = []
    try:
        kept = gc.get_freeze_count()
        monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
        monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
        Engine(CONFIG, loaded=loaded).run([_spec("h", *A)])
        monkeypatch.undo()
        assert calls == [] and gc.get_freeze_count() > kept // 2 > 0
    finally:
        gc.unfreeze()
    Engine(CONFIG, loaded=loaded).run([_spec("i", *A)])     # and a later run freezes and thaws again on its own
    assert gc.get_freeze_count() == 0


def _spec(rid, prompt, budget):
    from engine.workload import RequestSpec
    return RequestSpec(rid, prompt, budget)


def test_the_engine_takes_its_parts_at_construction(loaded):
    """Pool, scheduler and runner classes come in at construction (planted ones too), never patched in after."""
    from engine.pool import PagePool
    from engine.runner import ModelRunner
    from engine.scheduler import Scheduler

    class Pool(PagePool):
        pass

    class Sched(Scheduler):
        pass

    class Runner(ModelRunner):
        pass
    e = Engine(CONFIG, loaded=loaded, pool_cls=Pool, scheduler_cls=Sched, runner_cls=Runner)
    assert (type(e.pool), type(e.scheduler), type(e.runner)) == (Pool, Sched, Runner)
    assert e.scheduler.kv.pool is e.pool
    res = e.run([_spec("p", *A)])
    assert len(res["p"].tokens) == A[1]
