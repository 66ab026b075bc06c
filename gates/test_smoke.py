"""The smoke gate, run first: a few requests whose prompts end at page boundaries (64; 256 where flash decodes) and
prompt chunk boundaries, with short budgets, through every engine configuration against the `hf` golden under the
0.02 rule, in poison mode, and what each serves against its served record (gates/served.py). It takes seconds, so a
bug that changes numbers fails the run before the long gates start.
Its goldens are per device like every other's: a missing one fails with the command that makes it."""
from __future__ import annotations

import pytest

from engine.workload import SMOKE_CPU, get_workload

from . import served, summary, triage
from .compare import compare
from .runs import CANDIDATES, skip_unless_ahead, skip_unless_runs, workload_for
from .reference import LazyReference
from .teacher_forced import pages_left, teacher_forced
from .foresight_guard import guard_problems


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_smoke(runs, opts, engine, backend):
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, SMOKE_CPU.name)
    golden = runs.golden("hf", workload)
    cand, eng = runs.candidate(engine, backend, workload)
    # the hf model is loaded only if a flip needs teacher forcing (or a failure its triage)
    score = LazyReference(lambda: runs.reference("hf", workload)).score
    report = compare(f"smoke: {engine}[{backend}] vs hf on {workload}", golden, cand, score, opts.threshold,
                     opts.flip_cap, check_steps=False)
    summary.record(report)
    assert report.ok, triage.failure_message(report, eng, golden, score)
    # what is served, not only what it computes: captured steps, the fused append, the kernels (gates/served.py)
    moved = served.problems(opts, f"{engine}-{backend}", backend, eng)
    assert not moved, f"{engine}[{backend}] serves other than its record:\n  " + "\n  ".join(moved)


def test_served_defaults(opts):
    """Each engine configuration's defaults (no field given) against their record: a default that moves (the chunk
    budget, the rows, a kernel switch) changes what every user who passes nothing is served, while every gate runs
    its own workload's settings."""
    moved = served.default_problems(opts)
    assert not moved, "the engines' defaults moved:\n  " + "\n  ".join(moved)


def test_an_engine_keeps_no_schedule_log_unless_asked(runs, opts):
    """An engine built as users build it (no schedule_log) records no admission, wait, release or step end: the log
    the gates read grows by every event (about 730 bytes a request), which a server that runs for days must not.
    Every gate asks for the log, so a scheduler that kept it by default passed them all (session 18's campaign)."""
    from engine import Engine
    wl = workload_for(opts, SMOKE_CPU.name)
    ref = runs.engine_reference("fused", "torch", wl)
    e = Engine(ref.config, loaded=ref.loaded)
    e.run(get_workload(wl).requests()[:3])
    log = e.scheduler.log
    kept = {name: len(getattr(log, name)) for name in ("admissions", "waits", "releases", "ends")}
    assert not any(kept.values()), f"an engine built without a schedule log kept one: {kept} records"



def test_an_engine_keeps_the_last_steps_its_trace_limit_asks(runs, opts):
    """EngineConfig.trace_limit bounds the step trace a server keeps (every gate keeps the whole trace): exactly the
    last that many steps, in order."""
    from engine import Engine
    wl = workload_for(opts, SMOKE_CPU.name)
    ref = runs.engine_reference("fused", "torch", wl, trace_limit=4)
    e = Engine(ref.config, loaded=ref.loaded)
    e.run(get_workload(wl).requests()[:3])
    steps = e.scheduler.step_index
    kept = [rec.index for rec in e.trace]
    assert steps > 4 and kept == list(range(steps - 4, steps)), \
        f"trace_limit=4 after {steps} steps kept the steps {kept}, not the last 4"


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_smoke_steps_launched_ahead(runs, opts, engine, backend):
    """The smoke gate over the steps launched ahead (EngineConfig.overlap): each step foreseen and launched before
    the step before it is read back, its decode rows' tokens taken on the device. On CUDA the served defaults
    already launch ahead (test_smoke runs them); here every configuration whose kernels run the captured steps'
    path does so too: on a CPU that path runs uncaptured (cuda_graphs=True), so a bug in a step launched ahead fails
    the CPU gates in seconds. Poison mode stays on: the pages a step frees are poisoned before the launch after it."""
    workload = skip_unless_ahead(opts, engine, backend, SMOKE_CPU.name)
    golden = runs.golden("hf", workload)
    cand, eng = runs.candidate(engine, backend, workload, cuda_graphs=True, overlap=True)
    assert eng.steps_ahead > 0 and eng.ahead_discarded == 0, (
        f"{eng.steps_ahead} of {len(eng.trace)} steps ran launched ahead ({eng.ahead_discarded} launches dropped): "
        f"this gate compared serial steps, or the foresight was wrong")
    score = LazyReference(lambda: runs.reference("hf", workload)).score
    report = compare(f"smoke, steps launched ahead: {engine}[{backend}] vs hf on {workload}", golden, cand, score,
                     opts.threshold, opts.flip_cap, check_steps=False)
    summary.record(report)
    assert report.ok, triage.failure_message(report, eng, golden, score)


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_smoke_teacher_forced(runs, opts, engine, backend):
    """Engine.score() (teacher forcing) over the smoke golden's prompts and tokens, by the engine that served them:
    every emitted position ranks the golden's token first, or flips within a near tie (gates/teacher_forced.py)."""
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, SMOKE_CPU.name)
    golden = runs.golden("hf", workload)
    _, eng = runs.candidate(engine, backend, workload)
    report = teacher_forced(f"smoke, teacher-forced: {engine}[{backend}].score() vs hf on {workload}", eng, golden,
                            opts.threshold, opts.flip_cap)
    summary.record(report)
    assert report.ok, triage.failure_message(report)
    fresh = runs.engine_reference(engine, backend, workload).engine()      # score() before any step
    fresh.score(list(next(iter(golden.values())).prompt))
    left = pages_left(fresh)
    assert left is None, f"{engine}[{backend}], an engine that has served no step: {left}"


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_smoke_wrong_foresight_is_never_used(runs, opts, engine, backend):
    """Steps launched ahead from a foresight made wrong on purpose every other step (gates/foresight_guard.py: a row
    gone, the rows reversed, a chunk a position shorter) are dropped, never used: the run serves what the right
    foresight's run serves (test_smoke_steps_launched_ahead's), token by token and step by step; and so on three
    twin prompts that decode at equal positions (reversed rows there differ in nothing but which request they are)."""
    workload = skip_unless_ahead(opts, engine, backend, SMOKE_CPU.name)
    ref = runs.engine_reference(engine, backend, workload, cuda_graphs=True, overlap=True)
    _, right = runs.candidate(engine, backend, workload, cuda_graphs=True, overlap=True)
    problems, ways = guard_problems(ref, right, get_workload(workload).requests(), f"{engine}[{backend}]")
    assert not problems, (f"{engine}[{backend}], steps launched ahead from wrong foresights ({ways}):\n  "
                          + "\n  ".join(problems))
