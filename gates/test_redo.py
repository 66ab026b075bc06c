"""The all-or-nothing step as a gate: a step that an exception interrupts before its commit (while scheduled, once
launched, before its readback) is undone, and the next step() redoes it; the run then serves exactly what an
undisturbed run of the same configuration serves: every token, the step that emitted it, every prompt chunk, every
step of the trace. Run on the mixed workload (more requests than rows: admissions land while others run) through each
engine configuration, in poison mode, reusing the token gate's undisturbed run; in the same run a committed step's
poisoning of the pages it frees is interrupted (as a Ctrl-C held over the commit lands), and the next step must
poison them before it runs. A step launched ahead whose pages
were poisoned cannot be redone (Engine._undo fails the engine by design), so where steps launch ahead the interrupt
comes before that launch; and as served (poison off), where steps launch ahead, steps are interrupted once the step
after them is launched ahead (at that launch, and at their own readback): the launch is dropped and counted so, the
step redone, the run the undisturbed one.

With the prefix cache: a step that admits a request on cached pages and evicts other cached pages for it is
interrupted; its undo must leave the pool as before the step, but for the evicted pages, which come back free (last
on the free list): the pages found cached back in the LRU, in their old places. The redone run must then match the
undisturbed one step by step: free list, cached pages, LRU order, holders, cache counts, schedule log, tokens. And a
request that step admitted, cancelled during it, must go nowhere: no pages held, nothing cached, nothing computed."""
from __future__ import annotations

import random

import pytest

from engine.workload import get_workload

from .failure import GateFailure
from .runs import CANDIDATES, skip_unless_ahead, skip_unless_runs, workload_for
from .schedule_check import check_engine


class Interrupt(Exception):
    """Raised by the gate's step hook, as a failing kernel or a lost device call would raise."""


def served(e) -> dict:
    return {rid: (r.tokens, r.token_steps, r.chunks, r.state) for rid, r in e.results().items()}


def steps(e) -> list[tuple]:
    return [(t.index, t.kind, t.prompt_positions, t.decode_tokens, t.chunks, t.admitted) for t in e.trace]


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_an_interrupted_step_is_redone_identically(runs, opts, engine, backend):
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, "mixed-cpu")
    _, undisturbed = runs.candidate(engine, backend, workload)
    n = len(undisturbed.trace)
    # step index -> point: steps that admit while others run (an undo gives their pages and rows back), and one in
    # the middle of the run
    admitting = [t.index for t in undisturbed.trace if t.admitted and t.index > 0]
    at = {n // 2: "read-back" if not undisturbed.overlap else "scheduled", admitting[0]: "launched",
          admitting[-1]: "scheduled"}
    # and the step that admits the most requests: its undo hands back several reservations' pages, in order (one
    # admission alone never shows an undo that keeps only one reservation's pages: session 20's pool campaign)
    most = max(undisturbed.trace, key=lambda t: t.admitted)
    if most.admitted < 2:
        raise GateFailure(f"{engine}[{backend}] on {workload}: no step admits two requests, so no undo of several "
                          f"reservations is checked")
    at.setdefault(most.index, "scheduled")
    # and a committed step whose end frees pages, its poisoning interrupted (Ctrl-C is held over the commit and
    # delivered after it, where the freed pages are poisoned): the next step must poison them before it runs
    ends = {end.step: end.freed for end in undisturbed.scheduler.log.ends}
    frees = [i for i in range(1, n - 1) if ends.get(i) and not {i - 1, i, i + 1} & set(at)]
    if not frees:
        raise GateFailure(f"{engine}[{backend}] on {workload}: no step frees pages away from the interrupted ones, so "
                          f"no interrupted poisoning is checked")
    redo_run(runs.engine_reference(engine, backend, workload), workload, undisturbed, at,
             f"{engine}[{backend}] with interrupted steps on {workload}", poison_fails=frees[len(frees) // 2])


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_a_step_interrupted_after_the_next_is_launched_ahead_is_redone_as_served(runs, opts, engine, backend):
    """As served (poison off) with steps launched ahead: a step interrupted once the step after it is launched
    ahead (at the launch, and at its own readback) drops that launch and is redone; the run serves what the
    undisturbed one serves. Poison mode cannot redo such a step (the pages it frees are NaN already: Engine._undo
    fails the engine by design), so the first test interrupts before that launch; a server runs poison off."""
    workload = skip_unless_ahead(opts, engine, backend, "mixed-cpu")
    overrides = dict(cuda_graphs=True, overlap=True)
    _, undisturbed = runs.candidate(engine, backend, workload, **overrides)
    # steps whose successor ran launched ahead: interrupting them drops a launch in flight
    before_ahead = [a.index for a, b in zip(undisturbed.trace, undisturbed.trace[1:]) if b.ahead]
    if len(before_ahead) < 2:
        raise GateFailure(f"{engine}[{backend}] on {workload}: {len(before_ahead)} steps launched ahead, so no "
                          f"interrupt with a step launched ahead in flight is checked")
    at = {before_ahead[len(before_ahead) // 3]: "launched-ahead", before_ahead[2 * len(before_ahead) // 3]: "read-back"}
    e_ref = runs.engine_reference(engine, backend, workload, poison=False, **overrides)
    redo_run(e_ref, workload, undisturbed, at,
             f"{engine}[{backend}] as served (poison off, steps launched ahead), interrupted on {workload}",
             launched_ahead=True)


def redo_run(ref, workload: str, undisturbed, at: dict[int, str], label: str, launched_ahead: bool = False,
             poison_fails: int | None = None) -> None:
    """Serve `workload` on a new engine of `ref`, raising Interrupt at each step index of `at` as it passes its point
    (once each), stepping on after each; then the run must be what `undisturbed` served: every token, the step that
    emitted it, every prompt chunk, every step of the trace; and every scheduling invariant must hold.
    `poison_fails`: a step whose end's poisoning of the pages it frees raises (after its commit: the step stands);
    in poison mode those pages must be NaN when the next step is scheduled."""
    n = len(undisturbed.trace)
    fired: list[tuple[int, str]] = []
    unpoisoned: list[str] = []
    armed = []          # the step whose poisoning raises next

    def interrupt(point: str) -> None:
        plan = e.scheduler.plan
        if plan is not None and at.get(plan.index) == point and all(i != plan.index for i, _ in fired):
            fired.append((plan.index, point))
            raise Interrupt(f"interrupted at step {plan.index}, {point}")
        if poison_fails is None:
            return
        if point == "traced" and e.trace[-1].index == poison_fails:      # (the step's plan is closed by now)
            armed.append(poison_fails)
        if point == "scheduled" and plan.index == poison_fails + 1 and e.config.poison:
            freed = next(end.freed for end in e.scheduler.log.ends if end.step == poison_fails)
            caches = e.runner.kv_caches
            left = [p for p in freed if not all(t[p].isnan().all() for kv in caches for t in kv)]
            if left:
                unpoisoned.append(f"pages {left}, which step {poison_fails} freed (its poisoning interrupted after "
                                  f"its commit), are not NaN when step {plan.index} is scheduled: a kernel reading one "
                                  f"would go unseen")

    e = ref.engine(step_hook=interrupt)
    if poison_fails is not None:
        # the interrupt lands where the engine poisons the pages a step frees, after the step's commit: as a Ctrl-C
        # held over the commit (engine/sigint.py) is delivered, or a failing poison kernel (a fault injected into this
        # engine's runner alone, as the step hook injects the others)
        poison = e.runner.poison_pages

        def failing(pages):
            if armed:
                fired.append((armed.pop(), "poisoning"))
                raise Interrupt(f"interrupted while step {fired[-1][0]}'s freed pages {pages} were poisoned")
            poison(pages)
        e.runner.poison_pages = failing
    for s in get_workload(workload).requests():
        e.submit(s.prompt, s.budget, s.request_id)
    for _ in range(100 * n):
        if not e.scheduler.has_work:
            break
        try:
            e.step()
        except Interrupt:
            e.alive()           # undone, not failed: EngineDeadError here fails the gate with its cause
    else:
        raise GateFailure(f"{label}: no end after {100 * n} steps (the undisturbed run took {n})")
    if unpoisoned:
        raise GateFailure(f"{label}: {unpoisoned[0]}")
    check_engine(e, label)      # strict FCFS, eviction at the end of the step, pages back, provenance
    committed = sum(point == "poisoning" for _, point in fired)     # the step stands: not undone
    assert len(fired) - committed == len(at) and committed == (poison_fails is not None), \
        f"{label}: interrupts fired {fired}, planned {at} and the poisoning of step {poison_fails} (the run was shorter?)"
    if launched_ahead:
        # each interrupt dropped the step launched ahead on it (the rest of the run as the undisturbed one's)
        extra = e.ahead_discarded - undisturbed.ahead_discarded
        assert extra == len(fired) - committed, f"{label}: {len(fired)} interrupts with a step launched ahead in flight, the " \
                                    f"engine counts {extra} more steps launched ahead and dropped than undisturbed"
    # the count the census check allows extra forwards by (gates/dispatch.py): one undo an interrupt
    assert e.steps_undone == len(fired) - committed, f"{label}: {len(fired) - committed} steps interrupted before " \
                                                     f"their commit, the engine counts {e.steps_undone} undone"
    got, want = served(e), served(undisturbed)
    wrong = [rid for rid in want if got.get(rid) != want[rid]]
    if wrong or got.keys() != want.keys() or steps(e) != steps(undisturbed):
        rid = (wrong or [None])[0]
        raise GateFailure(
            f"{label}: interrupted at {fired} and redone, the run served something else than the undisturbed one: "
            f"{len(wrong)} requests differ" + (f", first {rid}: tokens, token steps, chunks, state {got.get(rid)} vs "
                                               f"{want[rid]}" if rid else "") +
            f"; steps {len(e.trace)} vs {n}, first differing step "
            f"{next((a for a, b in zip(steps(e), steps(undisturbed)) if a != b), None)}")


# The prefix cache's redo: served one request at a time (max_batch 1) in a pool of 7 pages (and the null page)
EVICTING_POOL_PAGES = 8
REDONE = "sys-b"        # the request whose admitting step (on cached pages, evicting) is interrupted


def evicting_requests(vocab: int, P: int, seed: int = 5) -> list[tuple[str, list[int], int]]:
    """(request id, prompt, budget) for pages of P slots: when sys-b is admitted, sys-a's 2 system-prompt pages and
    other's 3 prompt pages are cached and 2 pages free, so sys-b (5 pages) finds 2 cached, takes the 2 free ones and
    evicts other's last page; tail (4 pages) then evicts in the LRU order that step's undo must have restored."""
    rng = random.Random(seed)

    def rand(n):
        return [rng.randrange(3, vocab) for _ in range(n)]
    system = rand(2 * P)
    return [("sys-a", system + rand(1), 4), ("other", rand(3 * P), 4), (REDONE, system + rand(2 * P + 1), 4),
            ("tail", rand(3 * P), 4)]


def pool_state(pool) -> dict:
    """What an undo must restore: the free list in order, the cached pages (page -> key), those nobody holds in LRU
    order, the holders, the cache's counts."""
    c = pool.cache
    return dict(free=list(pool.free), lru=list(c.lru), cached={p: e.key for p, e in c.by_page.items()},
                owned={o: list(pages) for o, pages in pool.owned.items()}, lookups=c.lookups, hits=c.hits,
                evictions=c.evictions)


def differences(got: dict, want: dict) -> str:
    return "; ".join(f"{k} {got.get(k)} vs {want[k]}" for k in want if got.get(k) != want[k])


def serve_by_step(e, requests, undone=None) -> list[dict]:
    """Submit `requests` at once and step `e` to its end: the pool's state after each step that stood. A step that an
    Interrupt stopped is left to the next step() to redo, after `undone(the pool's state before the step)`."""
    for rid, prompt, budget in requests:
        e.submit(prompt, budget, rid)
    states = []
    for _ in range(100 * len(requests)):
        if not e.scheduler.has_work:
            return states
        before = pool_state(e.pool)
        try:
            e.step()
        except Interrupt:
            e.alive()           # undone, not failed: EngineDeadError here fails the gate with its cause
        else:
            states.append(pool_state(e.pool))
            continue
        undone(before)
    raise GateFailure(f"no end after {100 * len(requests)} steps")


@pytest.mark.parametrize("cancel", [False, True], ids=["redone", "cancelled"])
@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_an_interrupted_step_that_evicts_cached_pages_is_undone(runs, opts, engine, backend, cancel):
    skip_unless_runs(opts, engine, backend)
    # the mixed workload's configuration (its chunk budget), with the prefix cache, one row and a tight pool
    ref = runs.engine_reference(engine, backend, workload_for(opts, "mixed-cpu"), prefix_cache=True, max_batch=1,
                                num_pages=EVICTING_POOL_PAGES)
    undisturbed = ref.engine()
    requests = evicting_requests(runs.loaded[0].shape.vocab_size, undisturbed.config.page_size)
    want = serve_by_step(undisturbed, requests)
    label = f"{engine}[{backend}], prefix cache, {REDONE}'s admitting step interrupted" + \
        (f" and {REDONE} cancelled in it" if cancel else "")
    seen = {}       # REDONE's pages and hits in the interrupted step

    def interrupt(point: str) -> None:
        plan = e.scheduler.plan
        if point == "scheduled" and not seen and any(r.request_id == REDONE for r in plan.admitted):
            r = e.requests[REDONE]
            seen.update(pages=list(r.pages), hits=r.cached_prefix // e.pool.page_size)
            if cancel:          # a cancel during the step: the undo sends it nowhere (Scheduler.undo)
                e.cancel(REDONE)
            raise Interrupt(f"interrupted at step {plan.index}, {point}")

    def undone(before: dict) -> None:
        """The pool as before the step, but the pages it evicted (its new pages that were not free) come back free,
        last on the free list, in the order taken; the pages it found cached are back in the LRU, in place."""
        gone = [p for p in seen["pages"][seen["hits"]:] if p not in before["free"]]
        if not gone or not seen["hits"]:
            raise GateFailure(f"{label}: the interrupted step found {seen['hits']} pages cached and evicted {gone}: "
                              f"the workload no longer reaches the case (it must do both)")
        expect = dict(before, free=before["free"] + gone, lru=[p for p in before["lru"] if p not in gone],
                      cached={p: k for p, k in before["cached"].items() if p not in gone},
                      evictions=before["evictions"] + len(gone))
        diff = differences(pool_state(e.pool), expect)
        if diff:
            raise GateFailure(f"{label}: after the undo the pool is not as before the step but for the pages it "
                              f"evicted ({gone}, free last); got vs expected: {diff}")

    e = ref.engine(step_hook=interrupt)
    got = serve_by_step(e, requests, undone)
    if not seen:
        raise GateFailure(f"{label}: no step admitted {REDONE}, so none was interrupted")
    check_engine(e, label)      # every page back, the pool's invariants, provenance (nothing computed), strict FCFS
    if cancel:
        # nothing admits it again, so what its undo left stays to the end: its hits' places in the LRU (else they are
        # cached pages nobody can evict or find free), its positions (else computed by no step)
        r = e.results()[REDONE]
        if (r.state, r.tokens, r.chunks, r.cached_prefix, r.admit_time) != ("cancelled", [], [], 0, None):
            raise GateFailure(f"{label}: {REDONE} was cancelled in its undone step, so it never ran, but its result "
                              f"is state {r.state}, tokens {r.tokens}, chunks {r.chunks}, cached prefix "
                              f"{r.cached_prefix}, admitted at {r.admit_time}")
        return
    # redone: from here on as if never interrupted. The redo pins the same hits again, so a pool whose undo lost
    # their places in the LRU looks right after it; the free pages the redone step's admission saw (schedule log) do
    # not
    bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if bad is not None or len(got) != len(want):
        raise GateFailure(f"{label}: redone, the pool differs from the undisturbed run's after step {bad} "
                          f"({len(got)} steps vs {len(want)}); got vs undisturbed: "
                          f"{differences(got[bad], want[bad]) if bad is not None else '-'}")
    log, want_log = e.scheduler.log, undisturbed.scheduler.log
    if log.admissions != want_log.admissions or log.waits != want_log.waits:
        wrong = next(((a, b) for a, b in zip(log.admissions, want_log.admissions) if a != b), None)
        raise GateFailure(f"{label}: redone, the schedule log differs from the undisturbed run's: "
                          f"{len(log.admissions)} vs {len(want_log.admissions)} admissions, first differing (got, "
                          f"undisturbed) {wrong}; head waits {'differ' if log.waits != want_log.waits else 'equal'}")
    if served(e) != served(undisturbed) or steps(e) != steps(undisturbed):
        raise GateFailure(f"{label}: redone, the run served something else than the undisturbed one: "
                          f"{served(e)} vs {served(undisturbed)}; steps {steps(e)} vs {steps(undisturbed)}")
