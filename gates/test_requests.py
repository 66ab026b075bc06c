"""The request side as users drive it, on every engine configuration as served: while the mixed workload is served
(poison mode, record mode), requests are cancelled at every point of a step (waiting, between prompt chunks,
mid-decode, during a step's forward, and where the engine launches steps ahead, while the step after it is in
flight), and every way of refusing a request at submit is tried between steps, during a forward, while a step
launched ahead is in flight and after the last step, with a running request's result and an unknown id's asked for
too early (gates/traffic.py).

- a refused call raises its typed error (a RequestError) naming the cause, and changes nothing: the requests held,
  the queue, the running rows, the pool's pages and owners, the arrival count;
- a cancelled request keeps exactly a prefix of what the same configuration's run without this traffic emits, its
  pages come back at the end of the step after the cancel, and a no-op cancel says which;
- every other request's tokens and prompt chunks are identical to that run's, and the run keeps every scheduling
  invariant the gates check (gates/schedule_check.py);
- while a step is launched ahead, the pages the step before it frees are NaN already (poison mode poisons them
  before that launch, so a step launched ahead that reads one is caught);
- score() (teacher forcing) refuses each bad sequence at every one of those points the same way, and serves one of
  exactly the max positions (one more is refused);
- then every result is popped, as a server takes them: each is what results() listed, the engine forgets it, and
  a popped id and an automatic one are served again.

And requests that arrive while the engine serves (Engine.run(open_loop=True), as a server receives them): each
admitted no earlier than its arrival, the tokens those of the run where all arrive at once; and the same requests run
closed loop, stopped half-way by run(until=...) and run on: all arrive when run() starts, the tokens the same.

Where it runs: each candidate as this device serves it (on CUDA, flash with captured steps and steps launched ahead),
and on a CPU the configurations whose kernels run the captured steps' path uncaptured, with steps launched ahead
(the smoke gate's AHEAD_ON_CPU). The input checks themselves are engine/intake.py's; tests/test_bad_input.py tries
every form of bad input on the default configuration."""
from __future__ import annotations

import dataclasses
import time

import pytest

from engine.workload import SMOKE_CPU, get_workload

from .prefill_share_check import assert_no_problems, check_identical
from .schedule_check import engine_problems
from .runs import CANDIDATES, skip_unless_ahead, skip_unless_runs, tiny_pool_slots, workload_for
from .traffic import Traffic

WORKLOAD = "mixed-cpu"
AS_SERVED, AHEAD = "served", "ahead"


def checks_score_edges(opts, engine: str) -> bool:
    """Where a score() of exactly the max positions, and of exactly the whole pool, is served (one position more is
    refused in every case: gates/traffic.py, score_refusals). The edges are Engine.score's own bookkeeping, one code
    for every runner, and on a CPU a score of 8,192 positions takes 4-6 s (attention over every pair of positions):
    there one candidate's run checks them (fused's, or the first selected where fused is not); on a GPU every
    candidate's."""
    return opts.device != "cpu" or engine == ("fused" if "fused" in opts.engines else opts.engines[0])


@pytest.mark.parametrize("engine,backend,how", [(e, b, h) for e, b in CANDIDATES for h in (AS_SERVED, AHEAD)],
                         ids=[f"{e}-{b}-{h}" for e, b in CANDIDATES for h in (AS_SERVED, AHEAD)])
def test_refusals_and_cancels_leave_the_rest_identical(runs, opts, engine, backend, how):
    """The mixed workload served with the traffic of gates/traffic.py (refusals and early calls at four points,
    cancels at six), against the same configuration's run without it."""
    workload, overrides = workload_for(opts, WORKLOAD), {}
    if how == AHEAD:
        skip_unless_ahead(opts, engine, backend, WORKLOAD)
        overrides = dict(cuda_graphs=True, overlap=True)
        if runs.engine_reference(engine, backend, workload, **overrides).config.resolved() == \
                runs.engine_reference(engine, backend, workload).config.resolved():
            pytest.skip(f"{engine}[{backend}] already serves steps launched ahead here (the `{AS_SERVED}` case)")
    else:
        skip_unless_runs(opts, engine, backend)
    _, clean = runs.candidate(engine, backend, workload, **overrides)
    label = f"{engine}[{backend}]{' with steps launched ahead' if overrides else ''} on {workload}"
    traffic = Traffic(refuse=True, label=label)
    e = traffic.engine(runs.engine_reference(engine, backend, workload, **overrides))
    if overrides:
        assert e.overlap, f"{label}: the engine launches no step ahead, so this case proves nothing about them"
    traffic.serve(get_workload(workload).requests())
    if how == AS_SERVED and checks_score_edges(opts, engine) and e.pool.capacity * e.pool.page_size >= e.max_model_len:
        traffic.score_at(e.max_model_len, "exactly the max positions")
    assert_no_problems(traffic.check(clean.results(), whole=True) + traffic.pop_all(),
                       f"{label}, refused requests and {len(traffic.cancelled)} cancels ({traffic.cancelled})")


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_refusals_at_a_capped_pool(runs, opts, engine, backend):
    """After the page safety gate's capped-pool run (the same run: 256-slot pages, which every candidate decodes), a
    request larger than the whole pool is refused at submit (NeverFitsError, never left waiting), as is every other
    refusal, and nothing changes; a score() of exactly the whole pool is served, one position more refused. The
    mixed run's pool holds more than the max positions, so there the max positions refuse such a request first."""
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, WORKLOAD)       # as the page safety gate's capped pool
    slots = tiny_pool_slots(opts, runs.loaded[0].shape)
    _, e = runs.candidate(engine, backend, workload, page_size=256, num_pages=slots // 256 + 1)
    label = f"{engine}[{backend}] after its run in a pool of {e.pool.capacity} pages of 256"
    assert e.pool.capacity * e.pool.page_size < e.max_model_len, \
        f"{label}: the pool holds the max positions ({e.max_model_len}), so no request is too large for it alone"
    traffic = Traffic(refuse=True, label=label)
    traffic.e = e
    traffic.refuse_all("after the last step")
    if checks_score_edges(opts, engine):
        traffic.score_at(e.pool.capacity * e.pool.page_size, "exactly the whole pool")
        assert_no_problems(traffic.problems, f"{label}, score of the whole pool")
    for what in ("a request larger than the whole pool", "score of a sequence larger than the whole pool"):
        assert what in traffic.tried, f"{label}: the pool's refusal was not tried ({what})"


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_requests_arriving_while_the_engine_serves(runs, opts, engine, backend):
    """Engine.run(open_loop=True), as a server receives requests: the smoke workload's requests arrive in time on
    the engine's clock (half at once, then one every few milliseconds, the last after the run without arrivals would
    have ended, so the engine also waits with nothing to do). Each is admitted no earlier than its arrival and every
    scheduling invariant holds; tokens and chunks are identical to the smoke gate's run, where all arrive at once."""
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, SMOKE_CPU.name)
    _, closed = runs.candidate(engine, backend, workload)
    took = closed.trace[-1].start + closed.trace[-1].duration - closed.trace[0].start
    specs = get_workload(workload).requests()
    half = len(specs) // 2
    timed = [dataclasses.replace(s, arrival_time=0.0 if i < half else 0.005 * (i - half + 1))
             for i, s in enumerate(specs)]
    timed[-1] = dataclasses.replace(timed[-1], arrival_time=max(0.05, 1.2 * took))
    e = runs.engine_reference(engine, backend, workload).engine()
    e.reset_clock()             # the engine's clock reads 0 now: the arrival times are on it
    t0 = time.perf_counter()
    e.run(timed, open_loop=True)
    wall = time.perf_counter() - t0
    label = f"{engine}[{backend}] on {workload}, requests arriving in time"
    problems = engine_problems(e) + check_identical(closed.results(), e.results(), "all at once", "in time")
    times = [f"{s.request_id} admitted at {e.requests[s.request_id].admit_time:.4f} s on the engine's clock: before "
             f"its arrival at {s.arrival_time:.4f} s, or after the run's {wall:.4f} s" for s in timed
             if s.request_id in e.requests and not s.arrival_time <= e.requests[s.request_id].admit_time <= wall]
    assert_no_problems(problems + times, label)
    # the same requests closed loop (run()'s default: each arrives when run() starts, whatever its arrival time),
    # stopped by `until` half-way, as bench.disturbance stops a run, and run on to the end by a second run()
    c = runs.engine_reference(engine, backend, workload).engine()
    stop = max(1, len(closed.trace) // 2)
    c.run(timed, until=lambda eng: len(eng.trace) >= stop)
    label = f"{engine}[{backend}] on {workload}, all arriving at once, stopped after {stop} steps and run on"
    problems = [] if len(c.trace) == stop and c.scheduler.has_work else [
        f"run(until=...) returned after {len(c.trace)} steps with work left: {c.scheduler.has_work}; its until held "
        f"first before step {stop}, with work left"]
    c.run()
    late = [f"{s.request_id} arrived at {c.requests[s.request_id].arrival_time:.4f} s on the engine's clock, after the "
            f"first step started ({c.trace[0].start:.4f} s): a closed-loop run read its spec's arrival time "
            f"({s.arrival_time:.4f} s)" for s in timed
            if s.request_id in c.requests and c.requests[s.request_id].arrival_time > c.trace[0].start]
    problems += engine_problems(c) + check_identical(closed.results(), c.results(), "in one run", "stopped and run on")
    assert_no_problems(problems + late, label)
