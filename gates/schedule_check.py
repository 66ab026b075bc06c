"""Engine-level scheduling checks: a finished engine's schedule log (engine/schedule_log.py) against the admission
invariants of docs/DESIGN.md, on the real engine's run rather than on a model of the scheduler (the hypothesis gate,
gates/test_admission.py, does that). Every gate run of an engine is checked here (gates/conftest.py, Runs.candidate).

- strict FCFS admission: admissions in arrival order, none while an earlier arrival still waits, and the head admitted
  as soon as it fits (pages and a row);
- reserve on admit: ceil((prompt + budget) / page_size) pages, the same ones until released;
- max batch: at most max_batch rows held; no admission beyond the free pages;
- eviction at the end of the step: a release never reaches the free list inside the step, the step's end returns
  the pages released in it (but those still held by another request or cached), and a finished request is released
  at the end of the step of its last token;
- every page back: at the end of the run nothing is owned and the pool's own invariants hold;
- provenance: each cached position's writing step, as failure reports name it (Request.step_of), adds up per step to
  the prompt positions and decode tokens the step trace recorded (a wrong step in a failure would send triage to
  the wrong step); the pool names each page's last holder as the schedule log does; each result's times are in
  order (arrival, admission, first token = its first token's time, finish) and its queue wait is admission -
  arrival; in record mode every emitted token has its top-k;
- the debt's step times: each step's end gives the prefill-share debt the duration the step trace records."""
from __future__ import annotations

from collections import Counter

from engine.errors import PoolInvariantError
from engine.request import State
from engine.schedule_log import ScheduleLog
from engine.scheduler import StepKind

from .dispatch import autograd_problems, census_problems, dispatch_problems, poison_problems, served_problems
from .failure import GateFailure

# Invariant names: every failure message starts with one of these, followed by " violated: " (gates/test_admission.py
# uses the same names).
TOTAL = "free + owned = total"
OWNERS = "no page has two owners"
RESERVE = "reserve on admit"
FCFS = "strict FCFS admission"
ROWS = "max batch"
CAPACITY = "no admission beyond capacity"
EVICTION = "eviction at the end of the step"
NEVER_FITS = "never fits"
COMPLETES = "every request completes"
PAGES_BACK = "every page back"
PLAN = "step plan"
CANCEL = "cancel outcome"
STATE = "request state"
KEPT = "schedule log kept"
PROVENANCE = "provenance"
RECORD = "request record"
KIND = "step kind"
AHEAD = "steps launched ahead counted"
TIMES = "step times"
BLOCKED = "admission blocked"
DEBT_TIME = "the debt's step times"

SHOWN = 5     # problems quoted in a failure message


class ScheduleViolation(GateFailure):
    """A finished engine run broke an admission or eviction invariant; the message names it, the step and the
    requests."""


def ceil_pages(slots: int, page_size: int) -> int:
    """The gates' own rounding (whole pages, rounded up), independent of engine.pool."""
    return (slots + page_size - 1) // page_size


def admission_problems(log: ScheduleLog, max_batch: int, page_size: int) -> list[str]:
    out = []
    waits = {w.step: w for w in log.waits}
    last = None
    for a in log.admissions:
        who = f"step {a.step} admitted {a.request_id} (arrival {a.arrival})"
        if last is not None and a.arrival < last.arrival:
            out.append(f"{FCFS} violated: {who} after {last.request_id} (arrival {last.arrival}, admitted at step "
                       f"{last.step})")
        w = waits.get(a.step)
        if w is not None and w.arrival < a.arrival:
            out.append(f"{FCFS} violated: {who} while {w.request_id} (arrival {w.arrival}, needs "
                       f"{ceil_pages(w.slots, page_size)} pages) still waited")
        want = ceil_pages(a.prompt_len + a.budget, page_size)
        if len(a.pages) != want:
            out.append(f"{RESERVE} violated: {who} with {len(a.pages)} pages, ceil(({a.prompt_len} + {a.budget}) / "
                       f"{page_size}) = {want}")
        if len(a.pages) - a.hits > a.free_before:
            out.append(f"{CAPACITY} violated: {who} with {len(a.pages) - a.hits} new pages, {a.free_before} were "
                       f"free")
        if a.rows > max_batch:
            out.append(f"{ROWS} violated: {who}: {a.rows} rows held, max_batch is {max_batch}")
        last = a
    for w in log.waits:
        need = ceil_pages(w.slots, page_size)
        if need <= w.free and w.rows < max_batch:
            out.append(f"{FCFS} violated: step {w.step}: the head {w.request_id} (arrival {w.arrival}) waited though "
                       f"it fits: needs {need} pages, {w.free} free, {w.rows} of {max_batch} rows held")
    return out


def eviction_problems(log: ScheduleLog, last_token_step: dict[str, int]) -> list[str]:
    """`last_token_step`: request id -> step of its last token, for the requests that finished."""
    out = []
    given = {a.request_id: a.pages for a in log.admissions}
    released: dict[int, list[int]] = {}
    for r in log.releases:
        who = f"step {r.step} released {r.owner}'s pages {list(r.pages)}"
        if r.free_after > r.free_before:
            out.append(f"{EVICTION} violated: {who} straight to the free list during the step (free "
                       f"{r.free_before} -> {r.free_after}); pages may return only at the step's end")
        if not r.in_step:
            out.append(f"{EVICTION} violated: {who} outside a step")
        if r.owner in given and tuple(r.pages) != tuple(given[r.owner]):
            out.append(f"{RESERVE} violated: {who}, it was admitted with {list(given[r.owner])}")
        done = last_token_step.get(r.owner)
        if done is not None and done != r.step:
            out.append(f"{EVICTION} violated: {who}, its last token came at step {done}")
        released.setdefault(r.step, []).extend(r.pages)
    for e in log.ends:
        want = set(released.pop(e.step, []))
        lost = sorted(want - set(e.freed) - set(e.kept))
        extra = sorted(set(e.freed) - want)
        if lost or extra:
            out.append(f"{EVICTION} violated: the end of step {e.step} returned pages {sorted(e.freed)}, the step "
                       f"released {sorted(want)}" +
                       (f": {lost} were not returned (so never poisoned) and nobody holds them" if lost else "") +
                       (f": {extra} were never released" if extra else ""))
    return out


def pool_problems(pool) -> list[str]:
    out = []
    pending = getattr(pool, "pending", [])
    if pool.owned or pending or pool.num_free != pool.capacity:
        owners = sorted(pool.owned) + sorted(o for o, _ in pending)
        out.append(f"{PAGES_BACK} violated: {pool.capacity - pool.num_free} of {pool.capacity} pages are not free "
                   f"after the run (held by {owners[:SHOWN]})")
    try:
        pool.check()
    except PoolInvariantError as e:
        out.append(f"{TOTAL} violated: {e}")
    return out


def provenance_problems(requests, trace) -> list[str]:
    """Per step, the positions whose K/V `Request.step_of` says it wrote against the step trace's counts (steps the
    trace no longer holds, with a trace_limit, are left out); and no step for a request's first unwritten position."""
    prompt, decode, out = Counter(), Counter(), []
    for r in requests:
        if not 0 <= r.cached_prefix <= r.num_cached:
            out.append(f"{PROVENANCE} violated: {r.request_id} found {r.cached_prefix} prompt positions in the prefix "
                       f"cache, {r.num_cached} cached in all")
            continue
        for pos in range(r.cached_prefix, r.num_cached):
            step = r.step_of(pos)
            if step is None:
                out.append(f"{PROVENANCE} violated: {r.request_id} position {pos} is cached but no step wrote it")
                break
            (prompt if pos < r.prompt_len else decode)[step] += 1
        else:
            # the first position not written yet has no step (a failure report asks about pages half written)
            unwritten = r.step_of(r.num_cached)
            if unwritten is not None:
                out.append(f"{PROVENANCE} violated: {r.request_id} position {r.num_cached} is not written yet, but "
                           f"step_of names step {unwritten} for it")
    for rec in trace:
        got = (prompt[rec.index], decode[rec.index])
        if got != (rec.prompt_positions, rec.decode_tokens):
            out.append(f"{PROVENANCE} violated: step {rec.index} ({rec.kind.value}) wrote {rec.prompt_positions} "
                       f"prompt positions and {rec.decode_tokens} decode tokens, the requests' step_of names it for "
                       f"{got[0]} and {got[1]}")
    return out


def arrival_problems(requests) -> list[str]:
    """Arrival indices count the accepted submits: the engine's requests, in submit order, arrived in that order
    (strictly increasing from 0 at least: results popped leave gaps; strict FCFS orders by them, failure reports
    print them)."""
    got = [r.arrival_index for r in requests]
    if any(a >= b for a, b in zip(got, got[1:])) or (got and got[0] < 0):
        return [f"{FCFS} violated: the accepted requests' arrival indices, in submit order, are {got[:SHOWN * 2]}"
                f"{' ...' if len(got) > SHOWN * 2 else ''}; they must count the submits"]
    return []


def kind_problems(trace) -> list[str]:
    """Each step's kind (what the benches and the census sort steps by) against what it carried: prompt chunks and
    decode tokens (loaded), chunks only, decode tokens only, or nothing (idle)."""
    out = []
    for rec in trace:
        p, d = rec.prompt_positions > 0, rec.decode_tokens > 0
        want = (StepKind.LOADED if p and d else StepKind.CHUNK_ONLY if p else StepKind.PURE_DECODE if d else
                StepKind.IDLE)
        if rec.kind != want:
            out.append(f"{KIND} violated: step {rec.index} is {rec.kind.value} with {rec.prompt_positions} prompt "
                       f"positions and {rec.decode_tokens} decode tokens: a {want.value} step")
    return out[:SHOWN]


def time_problems(trace) -> list[str]:
    """Each traced step's start and duration on the engine's clock (what the benches, the step timings' sampling and
    the disturbance figures read): a duration at least 0, and a step ending before the next one starts."""
    out = []
    for a, b in zip(trace, trace[1:] + [None]):
        # (1e-9 s: start + (end - start) may land a rounding above end, which the next start may equal)
        if a.duration < 0 or (b is not None and a.start + a.duration > b.start + 1e-9):
            out.append(f"{TIMES} violated: step {a.index} starts at {a.start:.6f} s and lasts {a.duration:.6f} s"
                       + (f", the next starts at {b.start:.6f} s" if b is not None else ""))
    return out[:SHOWN]


def debt_time_problems(trace, log: ScheduleLog) -> list[str]:
    """Each traced step's duration against the seconds the scheduler was given for it at its end (the schedule log's
    StepEnd), which the prefill-share debt is computed from: the same measurement, or the debt rule runs on another
    clock than the one the trace, the benches and the debt's gates read (its gate, gates/prefill_share_check.py,
    drives the ledger with durations of its own; tokens are identical at every share). A trace cut by trace_limit
    holds its last steps: each is still in the log."""
    ends = {end.step: end for end in log.ends}
    out = []
    for rec in trace:
        end = ends.get(rec.index)
        given = None if end is None else end.duration
        if given != rec.duration:
            said = "no step end" if end is None else "no duration" if given is None else f"{given:.6f} s"
            out.append(f"{DEBT_TIME} violated: step {rec.index} lasted {rec.duration:.6f} s on the engine's clock, but "
                       f"its end gave the prefill-share debt {said}")
    return out[:SHOWN]


def blocked_problems(trace, log: ScheduleLog, max_batch: int) -> list[str]:
    """Each traced step's `admission_blocked` (the queue's head waited for pages while a row was free: what the
    benches count and the tiny-pool gate asks for) against the schedule log's head left waiting at that step and the
    rows then held. A trace cut by trace_limit holds its last steps: each is still in the log."""
    waits = {w.step: w for w in log.waits}
    out = []
    for rec in trace:
        w = waits.get(rec.index)
        want = w is not None and w.rows < max_batch
        if rec.admission_blocked != want:
            why = (f"{w.request_id} waited with {w.rows} of {max_batch} rows held" if w is not None else
                   "no request waited after its admissions")
            out.append(f"{BLOCKED} violated: step {rec.index} records admission_blocked={rec.admission_blocked}, but "
                       f"{why}")
    return out[:SHOWN]


def ahead_problems(engine) -> list[str]:
    """The engine's count of steps that ran launched ahead (the gates over steps launched ahead read it to know the
    run proves something about them) against its trace, where each step records whether it ran so, and none on an
    engine with overlap off (the GPU's overlap gate runs captured steps serially). A trace cut by trace_limit holds
    only its last steps: nothing to count against."""
    counted = getattr(engine, "steps_ahead", 0)      # (a stand-in engine of the tests may not count)
    if not getattr(engine, "overlap", True) and counted:
        # overlap off (asked, or where the runner cannot launch ahead): a served path the configuration turned off
        return [f"{AHEAD} violated: {counted} steps ran launched ahead on an engine that does not launch steps ahead "
                f"(overlap off)"]
    if engine.config.trace_limit is not None:
        return []
    n = sum(getattr(rec, "ahead", False) for rec in engine.trace)
    if counted != n:
        return [f"{AHEAD} violated: the engine counts {counted} steps that ran launched ahead, its trace {n} of "
                f"{len(engine.trace)}"]
    return []


def holder_problems(pool, log: ScheduleLog) -> list[str]:
    """The page holders failure reports name (PagePool.holder, and the step a page was freed at) against the schedule
    log's last release of each page, or score() that held it last (it runs between steps: before the releases of
    the step after it)."""
    last = {}
    events = sorted([(s.step, 0, s.owner, s.pages) for s in log.scores] +
                    [(r.step, 1, r.owner, r.pages) for r in log.releases], key=lambda ev: ev[:2])
    for step, _, owner, pages in events:
        for p in pages:
            last[p] = (owner, step)
    out = []
    for p, (owner, step) in sorted(last.items()):
        who, how = pool.holder(p)
        if who != owner or pool.last_owner.get(p) != (owner, step):
            out.append(f"{PROVENANCE} violated: page {p} was last released by {owner} at step {step}, the pool names "
                       f"{who} ({how}; last owner {pool.last_owner.get(p)})")
    return out[:SHOWN]


def record_problems(results) -> list[str]:
    """Each RequestResult's times: arrival <= admission <= first token <= finish, the first token's time is its
    first token's, and the queue wait is admission - arrival."""
    out = []
    for r in results:
        times = [t for t in (r.arrival_time, r.admit_time, r.first_token_time, r.finish_time) if t is not None]
        first = r.token_times[0] if r.token_times else None
        wait = None if r.admit_time is None else r.admit_time - r.arrival_time
        if times != sorted(times) or r.first_token_time != first or r.queue_wait != wait:
            out.append(f"{RECORD} violated: {r.request_id}: arrival {r.arrival_time}, admitted {r.admit_time}, "
                       f"first token {r.first_token_time} (its first token's time {first}), finished "
                       f"{r.finish_time}, queue wait {r.queue_wait}")
    return out[:SHOWN]


def topk_problems(engine) -> list[str]:
    """Record mode: one top-k entry per emitted token of every request (the 0.02 rule reads them at a flip), and
    each entry that token's top-k: k token ids (ints) with their logits, descending, the emitted (greedy) token
    among them at the top logit. The rule reads the entries only where two runs' tokens differ, which the gates'
    runs rarely do: ids and logits read back swapped (engine/readback.py's order) passed every gate on the H200."""
    if not engine.config.record_topk:
        return []
    out = [f"{RECORD} violated: {rid} emitted {len(r.output)} tokens, {len(engine.topk.get(rid, []))} top-k entries "
           f"were recorded" for rid, r in engine.requests.items() if len(engine.topk.get(rid, [])) != len(r.output)]
    k = engine.config.record_topk
    for rid, r in engine.requests.items():
        for pos, (token, (ids, vals)) in enumerate(zip(r.output, engine.topk.get(rid, []))):
            why = _topk_entry_problem(token, ids, vals, k)
            if why:
                out.append(f"{RECORD} violated: {rid}'s top-k entry at emitted position {pos} (token {token}): {why}")
                break
    return out[:SHOWN]


def _topk_entry_problem(token: int, ids, vals, k: int) -> str | None:
    if len(ids) != k or len(vals) != k:
        return f"{len(ids)} ids and {len(vals)} logits, not {k} of each"
    if not all(type(i) is int for i in ids) or not all(isinstance(v, float) for v in vals):
        return f"ids {ids[:4]} must be token ids (ints), logits {vals[:4]} floats: read back in another order?"
    if any(a < b for a, b in zip(vals, vals[1:])):
        return f"logits {vals[:4]}... are not descending"
    # greedy: the emitted token's logit is the top one (where more than k tie at the top, it may be left out)
    if token in ids and vals[ids.index(token)] != vals[0] or token not in ids and vals[-1] != vals[0]:
        return f"the emitted token is not at the top logit {vals[0]} of ids {ids[:4]}"
    return None


def engine_problems(engine) -> list[str]:
    """Every scheduling invariant broken by a finished engine run, in the order checked; then any kernel dispatched
    other than the configuration names (gates/dispatch.py)."""
    sched = engine.scheduler
    if not sched.log.keep:
        # an engine keeps no log unless asked (bounded memory): checking an empty one would pass anything
        return [f"{KEPT} violated: the engine recorded no schedule log, so nothing could be checked: build it with "
                f"Engine(..., schedule_log=ScheduleLog())"]
    finished = {rid: r.token_steps[-1] for rid, r in engine.requests.items()
                if r.state is State.FINISHED and r.token_steps}
    return (admission_problems(sched.log, sched.max_batch, engine.pool.page_size) +
            eviction_problems(sched.log, finished) + pool_problems(engine.pool) +
            provenance_problems(engine.requests.values(), engine.trace) + kind_problems(engine.trace) +
            ahead_problems(engine) + time_problems(engine.trace) +
            blocked_problems(engine.trace, sched.log, sched.max_batch) + debt_time_problems(engine.trace, sched.log) +
            arrival_problems(engine.requests.values()) +
            holder_problems(engine.pool, sched.log) +
            record_problems(engine.results().values()) + topk_problems(engine) + dispatch_problems(engine) +
            served_problems(engine) + census_problems(engine) + poison_problems(engine) +
            autograd_problems(engine))


def check_engine(engine, label: str) -> None:
    """Raise ScheduleViolation naming the first few broken invariants of a finished engine run."""
    problems = engine_problems(engine)
    if problems:
        more = f"\n  ... {len(problems) - SHOWN} more" if len(problems) > SHOWN else ""
        raise ScheduleViolation(f"{label}: the engine's schedule broke {len(problems)} invariant check(s):\n  " +
                                "\n  ".join(problems[:SHOWN]) + more)
