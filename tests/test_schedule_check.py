"""The engine-level scheduling checks (gates/schedule_check.py) fail on planted scheduler and pool bugs, naming the
invariant, the step and the requests: first on the scheduler and pool alone, then in a real engine run on the small
model, without the hypothesis gate (gates/test_admission.py) anywhere."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine import Engine, lineage_config
from engine.loader import load_model
from engine.pool import PagePool
from engine.request import Request, State
from engine.schedule_log import ScheduleLog
from engine.scheduler import Scheduler, StepKind, StepPlan
from engine.workload import Workload
from gates.schedule_check import ScheduleViolation, check_engine, engine_problems
from tests import plants

# Ten short requests in a pool of 6 pages of 64 slots: the head of the queue waits for pages while a later, smaller
# request would fit (first at step 8), and pages are released while others still run.
WORKLOAD = Workload("schedule-check", (8, 40, 200), (4, 12), 10, seed=4, chunk_tokens=128)
PAGES = 6


def drive(pool_cls=PagePool, scheduler_cls=Scheduler, pages: int = PAGES):
    """The scheduler and pool alone, stepped as Engine.step does (any token will do)."""
    pool = pool_cls(pages + 1, 64)
    sched = scheduler_cls(pool, chunk_tokens=WORKLOAD.chunk_tokens, log=ScheduleLog())
    requests = {}
    for s in WORKLOAD.requests():
        requests[s.request_id] = r = Request(s.request_id, s.prompt, s.budget)
        sched.add(r)
    while sched.has_work:
        plan = sched.schedule()
        plan.apply([7] * len(plan.sampled), 0.0)
        sched.finish_step()
    # no step trace, no results, no kernels, no cache: the provenance, record, dispatch, served, census and poison
    # checks have nothing to compare here
    no_kernels = SimpleNamespace(name="none", dispatched=set(), prefill_kernel="-", decode_kernel="-",
                                 decode_splits=None, appends_decode_kv=False, dynamic=False,
                                 graph_safe_prefill=False, static_steps=False)
    served = SimpleNamespace(decode_kernel="-", decode_splits=None, decode_append=False, flex_dynamic=False,
                             capture_graphs=False, forward="fused", tp=1, compile_elementwise=False)
    return SimpleNamespace(scheduler=sched, pool=pool, requests=requests, trace=[], results=dict, served=served,
                           config=SimpleNamespace(record_topk=0, trace_limit=None, poison=False),
                           runner=SimpleNamespace(path_census=lambda: [], backend=no_kernels, graphs=None,
                                                  device=SimpleNamespace(type="cpu")))


def first_problem(run) -> str:
    problems = engine_problems(run)
    assert problems, "the check passed a planted bug"
    return problems[0]


def test_unplanted_schedule_passes_and_is_tested():
    run = drive()
    assert engine_problems(run) == []
    log = run.scheduler.log
    assert len(log.admissions) == 10 and len(log.releases) == 10
    # not vacuous: the head waited for pages while rows were free
    assert any(w.rows < run.scheduler.max_batch for w in log.waits)


def test_queue_jump_is_caught():
    msg = first_problem(drive(scheduler_cls=plants.QueueJumpingScheduler))
    assert msg.startswith("strict FCFS admission violated: step 8 admitted schedule-check-0008 (arrival 8) while "
                          "schedule-check-0007 (arrival 7, needs 4 pages) still waited"), msg


@pytest.fixture
def no_pool_check(monkeypatch):
    """The pool's own invariant check off: the schedule check must catch the planted bug alone (with it on, the pool
    raises PoolInvariantError first, which is the engine's first line of defence)."""
    monkeypatch.setattr(PagePool, "check", lambda self: None)


def test_release_straight_to_the_free_list_is_caught(no_pool_check):
    msg = first_problem(drive(pool_cls=plants.EagerFreePool))
    assert msg.startswith("eviction at the end of the step violated: step "), msg
    assert "straight to the free list during the step" in msg and "pages [" in msg


def test_reservation_rounded_down_is_caught():
    msg = first_problem(drive(pool_cls=plants.FlooringPool, pages=PAGES + 2))
    assert msg.startswith("reserve on admit violated: step 0 admitted schedule-check-0000 (arrival 0) with 0 pages, "
                          "ceil((8 + 8) / 64) = 1"), msg


def test_admission_beyond_max_batch_is_caught():
    class OneRow(plants.OverfullScheduler):
        def __init__(self, pool, **kw):
            super().__init__(pool, max_batch=1, **kw)
    msg = first_problem(drive(scheduler_cls=OneRow, pages=60))
    assert msg.startswith("max batch violated: step 0 admitted schedule-check-0001 (arrival 1): 2 rows held, "
                          "max_batch is 1"), msg


class LateRetirement(Scheduler):
    """A finished request is retired one step after its last token."""

    def finish_step(self, duration=None):
        late = [r for r in self.running if r.state is State.FINISHED and r.token_steps[-1] == self.step_index]
        for r in late:
            r.state = State.DECODE
        freed = super().finish_step(duration)
        for r in late:
            r.state = State.FINISHED
        return freed


def test_late_release_is_caught():
    msg = first_problem(drive(scheduler_cls=LateRetirement))
    assert msg.startswith("eviction at the end of the step violated: step ") and "its last token came at step" in msg


class LeakyPool(PagePool):
    def release(self, owner):
        self.owned.pop(owner)          # the pages are dropped, neither pending nor free


def test_page_leak_is_caught(no_pool_check):
    problems = engine_problems(drive(pool_cls=LeakyPool, pages=60))
    assert any(p.startswith("every page back violated: ") for p in problems), problems


# -- a real engine run on the small model ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def engine_run(loaded) -> Engine:
    cfg = lineage_config("fused", poison=True, page_size=64, num_pages=PAGES + 1, chunk_tokens=WORKLOAD.chunk_tokens)
    eng = Engine(cfg, loaded=loaded, schedule_log=ScheduleLog())
    eng.run(WORKLOAD.requests(loaded[0].shape.vocab_size))
    return eng


def test_an_engine_keeps_no_log_unless_asked_and_the_check_refuses_it(loaded):
    """A served engine records nothing (a server's memory stays flat); the check then fails rather than pass an
    empty log."""
    cfg = lineage_config("fused", poison=True, page_size=64, num_pages=PAGES + 1, chunk_tokens=WORKLOAD.chunk_tokens)
    eng = Engine(cfg, loaded=loaded)
    eng.run(WORKLOAD.requests(loaded[0].shape.vocab_size))
    log = eng.scheduler.log
    assert not log.keep and not (log.admissions or log.waits or log.releases or log.ends)
    with pytest.raises(ScheduleViolation, match=r"schedule log kept violated: the engine recorded no schedule log"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_run_passes(loaded):
    eng = engine_run(loaded)
    check_engine(eng, "fused[torch] tiny pool")
    assert any(s.admission_blocked for s in eng.trace)


def test_real_engine_queue_jump_fails_the_check(loaded, monkeypatch):
    plants.fcfs(monkeypatch)
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"^fused\[torch\] tiny pool: the engine's schedule broke \d+ "
                                                r"invariant check\(s\):\n  strict FCFS admission violated: step \d+ "
                                                r"admitted \S+ \(arrival \d+\) while \S+ \(arrival \d+, needs \d+ "
                                                r"pages\) still waited"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_eager_free_fails_the_check(loaded, monkeypatch, no_pool_check):
    plants.eager_free(monkeypatch)
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"eviction at the end of the step violated: step \d+ released \S+'s "
                                                r"pages \[[\d, ]+\] straight to the free list during the step"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_provenance_off_by_one_fails_the_check(loaded, monkeypatch):
    """Found by the mutation campaign (docs/mutation.md): Request.step_of naming another chunk's step survived every
    gate, because only failure reports read it."""
    def step_of(self, pos):
        for (start, length), step in zip(self.chunks, self.chunk_steps):
            if start < pos <= start + length:      # the planted bug: one position late
                return step
        j = pos - self.prompt_len + 1
        return self.token_steps[j] if 1 <= j < len(self.token_steps) else None
    monkeypatch.setattr(Request, "step_of", step_of)
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"provenance violated: \S+ position 0 is cached but no step wrote "
                                                r"it"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_step_of_an_unwritten_position_fails_the_check(loaded, monkeypatch):
    """Found by the mutation campaign: step_of's decode bound `j <= len(token_steps)` (a step for the position the
    last token will fill) survived every gate."""
    def step_of(self, pos):
        for (start, length), step in zip(self.chunks, self.chunk_steps):
            if start <= pos < start + length:
                return step
        j = pos - self.prompt_len + 1
        return self.token_steps[min(j, len(self.token_steps) - 1)] if 1 <= j <= len(self.token_steps) else None
    monkeypatch.setattr(Request, "step_of", step_of)
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"provenance violated: \S+ position \d+ is not written yet, but "
                                                r"step_of names step \d+ for it"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_holder_forgotten_fails_the_check(loaded, monkeypatch):
    """Found by the mutation campaign: PagePool.release not recording each page's last owner survived every gate."""
    def release(self, owner):
        self.pending.append((owner, self.owned.pop(owner)))     # the planted bug: last_owner never written
    monkeypatch.setattr(PagePool, "release", release)
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"provenance violated: page \d+ was last released by \S+ at step "
                                                r"\d+, the pool names None \(never owned; last owner None\)"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_first_token_time_wrong_fails_the_check(loaded, monkeypatch):
    """Found by the mutation campaign: Request.first_token_time giving the last token's time survived every gate."""
    monkeypatch.setattr(Request, "first_token_time", property(lambda self: self.token_times[-1]
                                                              if self.token_times else None))
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"request record violated: \S+: arrival [\d.e-]+, admitted "
                                                r"[\d.e-]+, first token [\d.e-]+ \(its first token's time"):
        check_engine(eng, "fused[torch] tiny pool")


def test_step_of_names_the_step_whose_token_a_cancel_dropped():
    """A decode row that ran in a step during which its request was cancelled wrote the K/V of its last token's
    position; its token was dropped, so only Request.dropped_step can name that step (found by the cancellation gate
    once it cancelled during a forward: provenance said nothing wrote the position)."""
    r = Request("r", [1, 2, 3], 5)
    r.chunks, r.chunk_steps = [(0, 3)], [0]
    for step in (0, 1):
        assert r.emit(7, step, 0.0)
    r.state = State.CANCELLED
    assert not r.emit(7, 2, 0.0) and r.output == [7, 7]
    assert [r.step_of(p) for p in range(6)] == [0, 0, 0, 1, 2, None]


def test_real_engine_step_kind_wrong_fails_the_check(loaded, monkeypatch):
    """Found by the mutation campaign: StepPlan.kind calling a pure decode step loaded survived the schedule suite."""
    def kind(self):
        if self.chunks or self.decodes:          # the planted bug: any work is "loaded"
            return StepKind.LOADED
        return StepKind.IDLE
    monkeypatch.setattr(StepPlan, "kind", property(kind))
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"step kind violated: step \d+ is loaded with 0 prompt positions and "
                                                r"\d+ decode tokens: a pure-decode step"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_arrival_indices_not_counted_fail_the_check(loaded, monkeypatch):
    """Found by the mutation campaign: Scheduler.add numbering every request 0 (`next_arrival += 0`) survived."""
    def add(self, request):
        request.arrival_index = self.next_arrival        # the planted bug: the count never moves
        self.waiting.append(request)
    monkeypatch.setattr(Scheduler, "add", add)
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"strict FCFS admission violated: the accepted requests' arrival "
                                                r"indices, in submit order, are \[0, 0, 0"):
        check_engine(eng, "fused[torch] tiny pool")


def test_real_engine_arrival_indices_counted_from_minus_one_fail_the_check(loaded, monkeypatch):
    """Found by the mutation campaign (session 16): the count started at -1 (`next_arrival = -1`) survived; failure
    reports then named an 'arrival -1'."""
    init = Scheduler.__init__

    def planted(self, *a, **kw):
        init(self, *a, **kw)
        self.next_arrival = -1
    monkeypatch.setattr(Scheduler, "__init__", planted)
    eng = engine_run(loaded)
    with pytest.raises(ScheduleViolation, match=r"arrival indices, in submit order, are \[-1, 0, 1"):
        check_engine(eng, "fused[torch] tiny pool")


def test_topk_entries_are_each_emitted_tokens_top_k():
    """Record mode: each top-k entry holds token ids (ints) and their logits, descending, the emitted token at the top
    logit; ids and logits read back swapped (engine/readback.py's order, session 19's H200 campaign) are caught."""
    from gates.schedule_check import topk_problems
    good = [([5, 2, 9], [3.5, 1.0, -2.0]), ([7, 4, 1], [2.0, 2.0, 0.5])]

    def run(entries, output=(5, 4)):
        return SimpleNamespace(config=SimpleNamespace(record_topk=3), topk={"a": entries},
                               requests={"a": SimpleNamespace(output=list(output))})
    assert topk_problems(run(good)) == []           # a tie at the top: either tied token is the greedy one
    swapped = [(vals, ids) for ids, vals in good]
    assert topk_problems(run(swapped)) == [
        "request record violated: a's top-k entry at emitted position 0 (token 5): ids [3.5, 1.0, -2.0] must be "
        "token ids (ints), logits [5, 2, 9] floats: read back in another order?"]
    assert "not descending" in topk_problems(run([([5, 2, 9], [3.5, -2.0, 1.0]), good[1]]))[0]
    assert "not at the top logit 3.5" in topk_problems(run(good, output=(2, 4)))[0]
    assert "2 ids and 2 logits, not 3" in topk_problems(run([([5, 2], [3.5, 1.0]), good[1]]))[0]
    assert topk_problems(run(good[:1])) == [
        "request record violated: a emitted 2 tokens, 1 top-k entries were recorded"]


def test_the_count_of_steps_launched_ahead_is_checked_against_the_trace():
    """A count that starts at 1 (session 28's engine campaign) let a run with no step launched ahead pass the gates
    that ask for some: the count must be the trace's."""
    from types import SimpleNamespace as NS

    from gates.schedule_check import ahead_problems
    eng = NS(config=NS(trace_limit=None), trace=[NS(ahead=True), NS(ahead=False), NS(ahead=True)], steps_ahead=2)
    assert ahead_problems(eng) == []
    eng.steps_ahead = 3
    assert ahead_problems(eng) == ["steps launched ahead counted violated: the engine counts 3 steps that ran "
                                   "launched ahead, its trace 2 of 3"]
    eng.config.trace_limit = 2          # a cut trace: nothing to count against
    assert ahead_problems(eng) == []
    eng.overlap = False                 # but none may run launched ahead where overlap is off
    assert ahead_problems(eng) == ["steps launched ahead counted violated: 3 steps ran launched ahead on an engine "
                                   "that does not launch steps ahead (overlap off)"]


def test_step_times_are_checked_in_order():
    """A duration taken as end + start (session 28's engine campaign) passed every gate: the trace's times must not
    overlap, and no duration is negative."""
    from types import SimpleNamespace as NS

    from gates.schedule_check import time_problems
    trace = [NS(index=0, start=0.0, duration=0.5), NS(index=1, start=0.5, duration=0.25), NS(index=2, start=1.0,
                                                                                           duration=0.1)]
    assert time_problems(trace) == []
    trace[1].duration = 0.75
    assert time_problems(trace) == ["step times violated: step 1 starts at 0.500000 s and lasts 0.750000 s, the next "
                                    "starts at 1.000000 s"]
    trace[1].duration = -0.1
    assert len(time_problems(trace)) == 1


def test_the_debt_is_given_each_step_s_traced_duration():
    """The duration the engine gives the prefill-share debt taken as end + start (session 29's engine sample) passed
    every gate: tokens are identical at every share, and the debt rule's gate drives the ledger with durations of
    its own. Each step's end (the schedule log) must carry the trace's duration."""
    from types import SimpleNamespace as NS

    from engine.schedule_log import ScheduleLog, StepEnd
    from gates.schedule_check import debt_time_problems
    log = ScheduleLog()
    log.ends = [StepEnd(0, (), (), 0.5), StepEnd(1, (), (), 0.25)]
    trace = [NS(index=0, duration=0.5), NS(index=1, duration=0.25)]
    assert debt_time_problems(trace, log) == []
    assert debt_time_problems(trace[1:], log) == []      # a trace cut by trace_limit: its steps are in the log
    log.ends[1] = StepEnd(1, (), (), 1.75)
    assert debt_time_problems(trace, log) == ["the debt's step times violated: step 1 lasted 0.250000 s on the "
                                              "engine's clock, but its end gave the prefill-share debt 1.750000 s"]
    log.ends[1] = StepEnd(1, (), ())
    assert debt_time_problems(trace, log) == ["the debt's step times violated: step 1 lasted 0.250000 s on the "
                                              "engine's clock, but its end gave the prefill-share debt no duration"]
    log.ends = log.ends[:1]
    assert debt_time_problems(trace, log)[0].endswith("its end gave the prefill-share debt no step end")


def test_the_holders_failure_reports_name_count_score_as_a_holder():
    """score() holds pages between steps and gives them back: the pool then names it as their last holder, and the
    holder check must too (it once named the request released before, failing every gate run after a score()); a
    request that releases the page in a later step is its last holder again."""
    from engine.pool import PagePool
    from engine.schedule_log import ScheduleLog
    from gates.schedule_check import holder_problems
    pool, log = PagePool(8, 16), ScheduleLog()
    pool.begin_step()
    pool.reserve("a", 32)
    log.release(0, pool, "a")
    log.end_step(0, pool)
    assert holder_problems(pool, log) == []
    pages = pool.reserve(("score",), pool.capacity * 16)     # between steps, every page: "a"'s among them
    pool.release(("score",))
    pool.end_step()
    assert holder_problems(pool, log)[0].startswith("provenance violated: page ")     # unrecorded: named wrongly
    log.scored(1, ("score",), pages)
    assert holder_problems(pool, log) == []
    pool.begin_step()
    pool.reserve("b", 16)
    log.release(1, pool, "b")                   # step 1, after the score before it
    log.end_step(1, pool)
    assert holder_problems(pool, log) == []
