"""Steps launched ahead (EngineConfig.overlap): while a step runs on the device, the engine foresees the next step
(Scheduler.next_step: a pure decode or a loaded or chunk-only step into which nobody can be admitted), packs it and
launches it with its decode rows' input tokens taken on the device from the running step's samples; the real
schedule is then checked against the foreseen step, and a launch that does not match is dropped and the real step
run instead.

- the scheduler's foresight is exact: whenever it foresees a step, the next schedule (nothing submitted or cancelled
  in between) is that step: the same prompt chunks, the same decode rows at the same positions (property test, no
  model);
- an engine with overlap emits the same tokens at the same steps as one without, launches ahead pure decode and
  loaded steps, and drops no launch on a closed workload;
- submits and cancels between steps make the foreseen rows wrong: those launches are dropped and the tokens stay;
- planted: a step launched ahead that takes its tokens from the wrong rows, and an engine that trusts a wrong
  foresight without the check, are both caught by the comparison the overlap gate makes (gates/test_graphs.py).

Two modes (tests/conftest.py's graph_mode): cpu-emulated (the torch backend; a "replay" runs the same forward over
the same buffers, so the gather of the tokens and the launch order are those of the GPU) and cuda (real graphs)."""
from __future__ import annotations

import pytest
from hypothesis import event, given, settings, strategies as st

from engine import Engine
from engine.config import EngineConfig, lineage_config
from engine.pool import PagePool
from engine.request import Request
from engine.scheduler import Foresight, NextRow, Scheduler, StepKind
from engine.workload import Workload
from gates.compare import compare
from gates.reference import EngineReference

# more requests than rows, short prompts in one or two chunks, budgets that end at different steps
WORKLOAD = Workload("overlap-cpu", (4, 16, 40, 100), (3, 20), 12, chunk_tokens=64)
MAX_BATCH = 4
EMULATE_STEP_GRAPHS = True     # tests/conftest.py's cpu-emulated mode graphs loaded and chunk-only steps too


# -- the scheduler's foresight, without a model --------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 12)), min_size=1, max_size=14),
       st.integers(1, 5), st.sampled_from([16, 32, 64]), st.integers(6, 30), st.booleans(), st.sampled_from([0, 24]))
def test_next_step_foresees_the_next_schedule(reqs, max_batch, chunk, pages, cache, short):
    """For any workload, pool, chunk budget and short-prompt bound: a step foreseen during a step is exactly the
    next step's plan (its prompt chunks, and a decode row per request in order at its position, nobody admitted),
    with each row's source its index in the step's sampled rows, i.e. where its input token was sampled."""
    pool = PagePool(pages, 16, prefix_cache=cache)
    sched = Scheduler(pool, max_batch=max_batch, chunk_tokens=chunk, short_prompt_positions=short)
    for i, (n, budget) in enumerate(reqs):
        if pool.pages_needed(n + budget) <= pool.capacity:
            sched.add(Request(f"r{i}", [1 + (i * 5 + j) % 7 for j in range(n)], budget))
    foreseen, kinds = None, set()
    for _ in range(400):
        if not sched.has_work:
            break
        plan = sched.schedule()
        if foreseen is not None:
            assert not plan.admitted, plan
            assert [(c.request, c.start, c.length, c.long) for c in foreseen.chunks] == \
                [(c.request, c.start, c.length, c.long) for c in plan.chunks]
            assert [(a.request, a.num_cached) for a in foreseen.rows] == [(r, r.num_cached) for r in plan.decodes]
            kinds.add(plan.kind)
        foreseen = sched.next_step(plan)
        before = list(plan.sampled)
        plan.apply([2] * len(before), 0.0)
        sched.finish_step()
        for row in (foreseen.rows if foreseen else []):
            assert before[row.source] is row.request and row.output == (row.source,)
    assert not sched.has_work


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 90), st.integers(1, 12)), min_size=1, max_size=14),
       st.integers(1, 5), st.sampled_from([16, 32, 64]), st.integers(6, 30), st.booleans())
def test_pages_freed_by_is_the_steps_own_end(reqs, max_batch, chunk, pages, cache):
    """engine/foresight.pages_freed_by (poison mode's foresight of the pages a step frees) is what the step's own
    finish_step returns, for any workload, pool and chunk budget, with the prefix cache on or off and the schedule
    log kept (as in every gate run); and foreseeing changes nothing: the log records no event of the copy's."""
    from engine import foresight
    from engine.schedule_log import ScheduleLog
    pool = PagePool(pages, 16, prefix_cache=cache)
    sched = Scheduler(pool, max_batch=max_batch, chunk_tokens=chunk, log=ScheduleLog())
    for i, (n, budget) in enumerate(reqs):
        if pool.pages_needed(n + budget) <= pool.capacity:
            # shared first tokens: cached pages, and hits, when the cache is on
            sched.add(Request(f"r{i}", [1 + (j * 5 + (i % 2) * (j > 20)) % 7 for j in range(n)], budget))
    for _ in range(400):
        if not sched.has_work:
            break
        plan = sched.schedule()
        log = sched.log
        events = (len(log.admissions), len(log.releases), len(log.ends))
        # the waiting requests are shared with the copy, not copied: its step's end must not touch them
        held = [(r.request_id, r.state, r.num_cached, list(r.output), list(r.pages), r.chain)
                for r in (*sched.running, *sched.waiting)]
        foreseen = foresight.pages_freed_by(sched, plan)
        assert (len(log.admissions), len(log.releases), len(log.ends)) == events
        assert held == [(r.request_id, r.state, r.num_cached, list(r.output), list(r.pages), r.chain)
                        for r in (*sched.running, *sched.waiting)]
        plan.apply([2] * len(plan.sampled), 0.0)
        assert foreseen == sched.finish_step()
        event("pages freed" if foreseen else "none freed")
    assert not sched.has_work


def test_foresights_copies_share_nothing_mutable_and_keep_aliasing():
    """engine/copying.py (the copies pages_freed_by runs a step's end on): every container rebuilt, a container two
    holders share still shared by the copies, immutable ones shared, and the copied objects independent."""
    import copy
    from collections import OrderedDict, deque
    from engine.copying import copied
    from engine.request import State
    shared, atoms = [1, 2], (3, "a", b"k", None)
    value = {"x": shared, "y": shared, "nested": (1, [3]), "queue": deque([4, 5]), "set": {6}, "atoms": atoms,
             "map": {"r0": [7, 8]}, "lru": OrderedDict([(9, None), (3, [1])]), "state": State.DECODE,
             "last": {4: ("r0", 2), 5: ("r1", 3)}, "mixed": {6: ("r2", [1])}}
    c = copied(value, {})
    from engine.copying import immutable_values
    assert immutable_values({0: 1, 1: "a", 2: b"k", 3: 1.0, 4: True, 5: None}.values())    # all six atom types
    assert immutable_values({1: 2}.values()) and immutable_values({1: ("a", 2)}.values()) and immutable_values([])
    assert not immutable_values({1: [1]}.values()) and not immutable_values({1: ("a", [2])}.values())
    assert not immutable_values([1, ("a", 2)])      # atoms and pairs mixed: the entry-by-entry path (still right)
    # a map of immutable pairs (the pool's last owners): a new map sharing the pairs; a pair holding a list: copied
    assert c["last"] is not value["last"] and c["last"][4] is value["last"][4]
    assert c["mixed"][6] == ("r2", [1]) and c["mixed"][6][1] is not value["mixed"][6][1]
    assert c == value and c["x"] is c["y"] and c["x"] is not shared and c["atoms"] is atoms
    assert type(c["lru"]) is OrderedDict and list(c["lru"]) == [9, 3] and c["state"] is State.DECODE
    for k in ("nested", "queue", "set", "map", "lru"):
        assert c[k] is not value[k]
    c["nested"][1].append(9), c["map"]["r0"].append(9), c["queue"].append(9), c["x"].append(9)
    assert value["nested"] == (1, [3]) and value["map"] == {"r0": [7, 8]} and list(value["queue"]) == [4, 5]
    assert shared == [1, 2]
    pool = PagePool(12, 4, prefix_cache=True)
    r = Request("r0", [1, 2, 3, 4, 5], 3)
    pool.reserve("r0", 8)
    r.pages, r.output = pool.owned["r0"], [11]
    pool2, r2 = copy.deepcopy((pool, r))
    assert type(pool2) is PagePool and r2 == r and r2.pages is pool2.owned["r0"] and r2.pages is not r.pages
    pool2.release("r0"), pool2.end_step(), r2.output.append(12)
    assert pool.owned["r0"] == r.pages and r.output == [11] and pool.num_free == pool.capacity - 2


def test_foresight_declines_where_the_next_step_is_not_sure():
    """A step only where the next one is sure: not when a row frees for the queue's head, nor when every row
    finishes, nor with prompts still filling under a prefill share below 1 (the debt depends on this step's time).
    A prompt still filling gets its next chunk; a row whose prompt completes now decodes next, its token sampled
    among the completing chunks (which come first in a step's sampled rows)."""
    pool = PagePool(40, 16)
    sched = Scheduler(pool, max_batch=2, chunk_tokens=16)
    a, b, c = Request("a", [1] * 20, 5), Request("b", [1] * 4, 2), Request("c", [1] * 4, 2)
    for r in (a, b, c):
        sched.add(r)

    def step(chunks, rows):
        plan = sched.schedule()
        f = sched.next_step(plan)
        assert (None if f is None else ([(x.request, x.start, x.length) for x in f.chunks], f.rows)) == \
            (None if rows is None else (chunks, rows))
        plan.apply([2] * len(plan.sampled), 0.0)
        sched.finish_step()
        return plan

    step([(a, 16, 4), (b, 0, 4)], [])                # a's first chunk: its second and b's prompt come next
    step([], [NextRow(a, 20, 0), NextRow(b, 4, 1)])  # both prompts complete, the queue's head waits for a row
    step(None, None)                                 # b's last token: c takes its row next step
    plan = step([], [NextRow(a, 22, 1), NextRow(c, 4, 0)])   # c's prompt completes beside a's decode row
    assert plan.admitted == [c] and plan.sampled == [c, a]
    step([], [NextRow(a, 23, 0)])                    # c's last token, the queue is empty: a decodes on alone
    step(None, None)                                 # a's last token: nothing to decode
    assert not sched.has_work
    shared = Scheduler(PagePool(40, 16), max_batch=2, chunk_tokens=16, prefill_share=0.5)
    shared.add(Request("d", [1] * 40, 3))
    assert shared.next_step(shared.schedule()) is None   # d's next chunk may wait for the decoders' debt


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


def test_overlap_emits_the_same_tokens_at_the_same_steps(mode, monkeypatch):
    from engine.runner import ModelRunner
    launched = []
    real = ModelRunner.launch_ahead

    def recorded(self, step, *args):
        out = real(self, step, *args)
        launched.append((bool(step.chunks), out is not None))
        return out

    _, base = run(mode, False)
    monkeypatch.setattr(ModelRunner, "launch_ahead", recorded)
    ref, over = run(mode, True)
    eng = ref.last_engine
    pure = sum(s.kind == StepKind.PURE_DECODE for s in eng.trace)
    mixed = sum(s.kind in (StepKind.LOADED, StepKind.CHUNK_ONLY) for s in eng.trace)
    report = check("overlap vs serial", mode, base, over)
    assert report.ok, report.problems()
    # on a closed workload the foresight is never wrong; it covers most steps (all but those after a step whose
    # rows finish while the queue waits), pure decode and loaded ones
    assert eng.ahead_discarded == 0
    assert len(eng.trace) > eng.steps_ahead > len(eng.trace) // 2, (eng.steps_ahead, len(eng.trace))
    assert eng.steps_ahead == sum(ok for _, ok in launched)
    assert sum(chunks and ok for chunks, ok in launched) > 0, "no loaded or chunk-only step was launched ahead"
    assert eng.runner.graphs.replays == pure and eng.runner.step_graphs.replays == mixed


def test_a_long_prompt_alone_is_launched_ahead_chunk_by_chunk(mode):
    """One request whose prompt takes four chunk-only steps, the first three sampling nothing: each next chunk is
    launched ahead (it takes no token from the step before), then its decode steps; the tokens are the serial
    engine's."""
    def serve(overlap):
        eng = Engine(lineage_config(mode["engine"], device=mode["device"], dtype=mode["dtype"], chunk_tokens=32,
                                    max_batch=2, cuda_graphs=True, overlap=overlap, max_model_len=160,
                                    progress=False), mode["model"])
        eng.submit([3 + (7 * i) % 50 for i in range(120)], 6, "long")
        eng.run()
        return eng.results()["long"].tokens, eng
    tokens, eng = serve(True)
    assert tokens == serve(False)[0]
    assert [s.kind for s in eng.trace[:4]] == [StepKind.CHUNK_ONLY] * 4
    assert eng.steps_ahead == len(eng.trace) - 1 and eng.ahead_discarded == 0


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
    real = Scheduler.next_step

    def shifted(self, plan):
        f = real(self, plan)
        if f and len(f.rows) > 1:
            rows = f.rows
            f = Foresight(f.chunks, [NextRow(r.request, r.num_cached, rows[(i + 1) % len(rows)].source)
                                     for i, r in enumerate(rows)])
        return f

    _, base = run(mode, False)
    monkeypatch.setattr(Scheduler, "next_step", shifted)
    ref, over = run(mode, True)
    assert ref.last_engine.steps_ahead > 0
    report = check("overlap vs serial (planted: tokens from the wrong rows)", mode, base, over)
    assert not report.ok
    assert any("token" in p for p in report.problems()), report.problems()


def test_planted_unchecked_foresight_is_caught(mode, monkeypatch):
    """An engine that uses a launch without checking it against the real schedule, with a foresight that ignores
    the queue: admissions go missing."""
    real = Scheduler.next_step

    def blind(self, plan):
        waiting, self.waiting = self.waiting, []
        try:
            return real(self, plan)
        finally:
            self.waiting = waiting

    _, base = run(mode, False)
    monkeypatch.setattr(Scheduler, "next_step", blind)
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


# -- poison mode keeps steps launched ahead (issue 32) --------------------------------------------------------------
def freed_page_read(monkeypatch, engine, poison_before_launch: bool = True) -> None:
    """Plant: a step launched ahead reads, through its first row's first block-table entry, a page that the step in
    flight before it frees at its end, instead of that row's own first page. `poison_before_launch=False` takes the
    engine's foresight of those pages away (as before: they were poisoned only at the end of that step)."""
    runner, freeing = engine.runner, []
    foresee, launch_ahead = engine.pages_freed_by, runner.launch_ahead

    def pages_freed_by(plan):
        freeing[:] = foresee(plan)
        return list(freeing) if poison_before_launch else []

    def launch(step, pages_of, source, forward_mode):
        if freeing and step.rows:
            rid = step.rows[0].request.request_id
            pages_of = {**pages_of, rid: [freeing[0]] + pages_of[rid][1:]}
        return launch_ahead(step, pages_of, source, forward_mode)
    monkeypatch.setattr(engine, "pages_freed_by", pages_freed_by)
    monkeypatch.setattr(runner, "launch_ahead", launch)


def test_poison_mode_keeps_steps_launched_ahead_and_poisons_freed_pages_before_them(monkeypatch, loaded):
    """Poison mode no longer turns overlap off: the pages a step frees are poisoned before the step launched after it
    (Engine.pages_freed_by foresees them), so a step launched ahead that reads a page freed by the step before it
    gets NaN logits and the engine names it, as it would between two serial steps. Without that foresight (as
    before), the same read finds the page's stale, finite contents and nothing is reported."""
    from engine import PoisonedLogitsError

    def engine():
        # no prefix cache: a finished request's full pages are then freed, not kept cached; its first page is full
        # (every slot written), so reading it unpoisoned finds finite keys
        e = Engine(EngineConfig(cuda_graphs=True, overlap=True, poison=True, progress=False, prefix_cache=False),
                   loaded=loaded)
        assert e.overlap
        for i, (n, budget) in enumerate([(70, 3), (70, 12), (9, 12), (40, 12)]):
            e.submit([3 + (i * 7 + j) % 50 for j in range(n)], budget, request_id=f"r{i}")
        return e
    clean = engine()
    clean.run()
    assert clean.steps_ahead > 0
    planted = engine()
    freed_page_read(monkeypatch, planted)
    with pytest.raises(PoisonedLogitsError, match=r"non-finite logits for \['r1'\]"):
        planted.run()
    unseen = engine()
    freed_page_read(monkeypatch, unseen, poison_before_launch=False)
    unseen.run()          # the read goes unseen: the page still holds its last owner's keys and values
    assert unseen.steps_ahead > 0
