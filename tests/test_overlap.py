"""Steps launched ahead (EngineConfig.overlap): while a step runs on the device, the engine foresees the next pure
decode step (Scheduler.next_decodes), packs it and launches it with its input tokens taken on the device from the
running step's samples; the real schedule is then checked against the foreseen rows, and a launch that does not match
is dropped and the real step run instead.

- the scheduler's foresight is exact: whenever it foresees rows, the next schedule (nothing submitted or cancelled in
  between) is a pure decode step over exactly those rows at those positions (property test, no model);
- an engine with overlap emits the same tokens at the same steps as one without, launches ahead on most pure decode
  steps, and drops no launch on a closed workload;
- submits and cancels between steps make the foreseen rows wrong: those launches are dropped and the tokens stay;
- planted: a step launched ahead that takes its tokens from the wrong rows, and an engine that trusts a wrong
  foresight without the check, are both caught by the comparison the overlap gate makes (gates/test_graphs.py).

Two modes (tests/conftest.py's graph_mode): cpu-emulated (the torch backend; a "replay" runs the same forward over
the same buffers, so the gather of the tokens and the launch order are those of the GPU) and cuda (real graphs)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from engine import Engine
from engine.config import lineage_config
from engine.pool import PagePool
from engine.request import Request
from engine.scheduler import NextRow, Scheduler, StepKind
from engine.workload import Workload
from gates.compare import compare
from gates.reference import EngineReference

# more requests than rows, short prompts in one or two chunks, budgets that end at different steps
WORKLOAD = Workload("overlap-cpu", (4, 16, 40, 100), (3, 20), 12, chunk_tokens=64)
MAX_BATCH = 4


# -- the scheduler's foresight, without a model --------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 12)), min_size=1, max_size=14),
       st.integers(1, 5), st.sampled_from([16, 32, 64]), st.integers(6, 30), st.booleans())
def test_next_decodes_foresees_the_next_schedule(reqs, max_batch, chunk, pages, cache):
    """For any workload, pool and chunk budget: rows foreseen during a step are exactly the next step's plan (a pure
    decode step over those requests, in order, at those positions), with each row's source its index in the step's
    sampled rows, i.e. where its input token was sampled."""
    pool = PagePool(pages, 16, prefix_cache=cache)
    sched = Scheduler(pool, max_batch=max_batch, chunk_tokens=chunk)
    for i, (n, budget) in enumerate(reqs):
        if pool.pages_needed(n + budget) <= pool.capacity:
            sched.add(Request(f"r{i}", [1 + (i * 5 + j) % 7 for j in range(n)], budget))
    foreseen = None
    for _ in range(400):
        if not sched.has_work:
            break
        plan = sched.schedule()
        if foreseen is not None:
            assert not plan.chunks and not plan.admitted, plan
            assert [(a.request, a.num_cached) for a in foreseen] == [(r, r.num_cached) for r in plan.decodes]
        foreseen = sched.next_decodes(plan)
        before = list(plan.sampled)
        plan.apply([2] * len(before), 0.0)
        sched.finish_step()
        for row in foreseen or []:
            assert before[row.source] is row.request and row.output == (row.source,)
    assert not sched.has_work


def test_foresight_declines_where_the_next_step_is_not_sure():
    """Rows only where the next step is sure: not while a prompt is still filling, nor when a row frees for the
    queue's head, nor when every row finishes; a row whose prompt completes now decodes next, its token sampled
    among the completing chunks (which come first in a step's sampled rows)."""
    pool = PagePool(40, 16)
    sched = Scheduler(pool, max_batch=2, chunk_tokens=16)
    a, b, c = Request("a", [1] * 20, 5), Request("b", [1] * 4, 2), Request("c", [1] * 4, 2)
    for r in (a, b, c):
        sched.add(r)

    def step(expect):
        plan = sched.schedule()
        assert sched.next_decodes(plan) == expect
        plan.apply([2] * len(plan.sampled), 0.0)
        sched.finish_step()
        return plan

    step(None)                                       # a's first chunk; its second is still to come
    step([NextRow(a, 20, 0), NextRow(b, 4, 1)])      # both prompts complete, the queue's head waits for a row
    step(None)                                       # b's last token: c takes its row next step
    plan = step([NextRow(a, 22, 1), NextRow(c, 4, 0)])   # c's prompt completes beside a's decode row
    assert plan.admitted == [c] and plan.sampled == [c, a]
    step([NextRow(a, 23, 0)])                        # c's last token, the queue is empty: a decodes on alone
    step(None)                                       # a's last token: nothing to decode
    assert not sched.has_work


# -- an engine with and without overlap ------------------------------------------------------------------------------
def run(mode, overlap: bool, driver=None, **kw):
    ref = EngineReference(mode["engine"], mode["model"], device=mode["device"], dtype=mode["dtype"],
                          chunk_tokens=WORKLOAD.chunk_tokens, max_batch=MAX_BATCH, cuda_graphs=True,
                          overlap=overlap, max_model_len=160, progress=False, **kw)
    return ref, ref.generate(WORKLOAD.requests())


def check(name, mode, base, other):
    ref = EngineReference(mode["engine"], mode["model"], device=mode["device"], dtype=mode["dtype"],
                          cuda_graphs=False, max_model_len=160, progress=False)
    return compare(name, base, other, ref.score, check_steps=True)


@pytest.fixture
def mode(graph_mode, one_torch_thread):
    return graph_mode


def test_overlap_emits_the_same_tokens_at_the_same_steps(mode):
    _, base = run(mode, False)
    ref, over = run(mode, True)
    eng = ref.last_engine
    pure = sum(s.kind == StepKind.PURE_DECODE for s in eng.trace)
    report = check("overlap vs serial", mode, base, over)
    assert report.ok, report.problems()
    # on a closed workload the foresight is never wrong, and it covers most pure decode steps (all but those after
    # a step whose rows finish while the queue waits)
    assert eng.ahead_discarded == 0
    assert pure >= eng.steps_ahead > pure // 2, (eng.steps_ahead, pure)
    assert eng.runner.graphs.replays == pure


def serve_with_interference(mode, overlap: bool) -> tuple[dict, Engine]:
    """Requests served step by step, with a submit and a cancel between steps while rows decode: the step launched
    ahead (if any) was foreseen without them."""
    eng = Engine(lineage_config(mode["engine"], device=mode["device"], dtype=mode["dtype"], chunk_tokens=64,
                                max_batch=MAX_BATCH, cuda_graphs=True, overlap=overlap, max_model_len=160,
                                progress=False, record_topk=0), mode["model"])
    specs = WORKLOAD.requests()
    for s in specs[:3]:
        eng.submit(s.prompt, s.budget, s.request_id)
    n = 0
    while eng.scheduler.has_work and n < 300:
        eng.step()
        n += 1
        if n == 6:
            eng.cancel(specs[1].request_id)          # decoding by now
        if n in (9, 14):
            s = specs[3 if n == 9 else 4]
            eng.submit(s.prompt, s.budget, s.request_id)
    return {rid: (r.tokens, r.token_steps, r.state) for rid, r in eng.results().items()}, eng


def test_submits_and_cancels_between_steps_drop_the_launch_not_the_tokens(mode):
    base, _ = serve_with_interference(mode, False)
    over, eng = serve_with_interference(mode, True)
    assert eng.ahead_discarded >= 2 and eng.steps_ahead > 0, (eng.ahead_discarded, eng.steps_ahead)
    assert over == base


# -- planted: what the overlap gate must catch ----------------------------------------------------------------------
def test_planted_wrong_token_source_is_caught(mode, monkeypatch):
    """Each row launched ahead takes the next row's token: the step computes the wrong continuation."""
    real = Scheduler.next_decodes

    def shifted(self, plan):
        rows = real(self, plan)
        if rows and len(rows) > 1:
            rows = [NextRow(r.request, r.num_cached, rows[(i + 1) % len(rows)].source) for i, r in enumerate(rows)]
        return rows

    _, base = run(mode, False)
    monkeypatch.setattr(Scheduler, "next_decodes", shifted)
    ref, over = run(mode, True)
    assert ref.last_engine.steps_ahead > 0
    report = check("overlap vs serial (planted: tokens from the wrong rows)", mode, base, over)
    assert not report.ok
    assert any("token" in p for p in report.problems()), report.problems()


def test_planted_unchecked_foresight_is_caught(mode, monkeypatch):
    """An engine that uses a launch without checking it against the real schedule, with a foresight that ignores
    the queue: admissions go missing."""
    real = Scheduler.next_decodes

    def blind(self, plan):
        waiting, self.waiting = self.waiting, []
        try:
            return real(self, plan)
        finally:
            self.waiting = waiting

    _, base = run(mode, False)
    monkeypatch.setattr(Scheduler, "next_decodes", blind)
    checked_ref, checked = run(mode, True)
    assert checked_ref.last_engine.ahead_discarded > 0     # the check drops them
    assert check("overlap vs serial (blind foresight, checked)", mode, base, checked).ok
    if mode["device"] != "cpu":
        return      # unchecked, the gather below indexes past the samples: on CUDA a device assert ends the process
    monkeypatch.setattr(Engine, "matches", staticmethod(lambda rows, plan: True))
    try:
        _, unchecked = run(mode, True)
    except IndexError as e:             # the samples of a step with fewer rows than the real one, indexed by it
        assert "index out of range" in str(e)
        return
    report = check("overlap vs serial (planted: unchecked)", mode, base, unchecked)
    assert not report.ok, "an unchecked launch ahead went unseen"


def test_overlap_config():
    """overlap=True where it cannot run is a ConfigError naming why; None is off there."""
    from engine.errors import ConfigError
    with pytest.raises(ConfigError, match="overlap=True but launching a step ahead needs the captured"):
        Engine(lineage_config("fused", overlap=True, progress=False))
    with pytest.raises(ConfigError, match="overlap"):
        lineage_config("fused", overlap="yes")
    assert Engine(lineage_config("fused", progress=False)).overlap is False
