"""submit and cancel from other threads while one thread steps (issue 16), with real threads, in poison mode on the
small model: no page leaks, the survivors' tokens are those of a clean single-threaded run, a cancelled request
emits nothing after its cancel and releases its pages at the end of the step the cancel landed in. A planted emit
that overwrites the cancelled state (main's bug) is caught."""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import pytest

from engine import Engine, EngineConfig
from engine.request import Request, State
from engine.workload import Workload

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = EngineConfig(poison=True, chunk_tokens=64, max_batch=8, num_pages=25)   # 24 pages: admission blocks too
WORKLOAD = Workload("threads-cpu", (4, 16, 40, 100), (4, 24), 48, chunk_tokens=64)
CANCEL_SHARE = 0.4


@pytest.fixture(scope="module")
def clean(loaded):
    """Every request served to completion by one thread, nothing cancelled."""
    e = Engine(CONFIG, loaded=loaded)
    return {rid: r.tokens for rid, r in e.run(WORKLOAD.requests()).items()}


@dataclass
class Cancel:
    rid: str
    outcome: str
    emitted: int              # tokens the request had when the cancel returned
    due: int                  # the step whose end must retire it: the open step if one ran, else the next
    mid_step: bool            # it landed while a step was open (during its forward)


@dataclass
class Run:
    cancels: dict[str, Cancel] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)     # owner -> the step its pages were released in
    errors: list[str] = field(default_factory=list)


def threaded_run(loaded, seed: int = 0) -> tuple[Engine, Run]:
    """A submitter, a canceller and the stepping thread on one engine."""
    e = Engine(CONFIG, loaded=loaded)
    run = Run()
    release = e.pool.release

    def recording_release(owner):
        run.released[owner] = e.pool.step
        release(owner)
    e.pool.release = recording_release
    specs = WORKLOAD.requests()
    rng = random.Random(seed)
    doomed = [s.request_id for s in specs if rng.random() < CANCEL_SHARE]
    submitted, done = threading.Event(), threading.Event()

    def guard(fn):
        def body():
            try:
                fn()
            except BaseException as ex:    # a failure in a thread must fail the test, not vanish
                run.errors.append(f"{fn.__name__}: {type(ex).__name__}: {ex}")
                done.set()
        return body

    def submitter():
        r = random.Random(seed + 1)
        for s in specs:
            e.submit(s.prompt, s.budget, s.request_id)
            time.sleep(r.uniform(0, 0.004))
        submitted.set()

    def canceller():
        r = random.Random(seed + 2)
        for i, rid in enumerate(doomed):
            # every fourth as soon as it is queued (usually still waiting), the others once admitted
            while not done.is_set() and not (rid in e.requests and (i % 4 == 0 or e.requests[rid].state is not
                                                                    State.WAITING)):
                time.sleep(0.0005)
            time.sleep(r.uniform(0, 0.02))
            with e.lock:     # read the step that is open (if any) atomically with the cancel
                plan = e.scheduler.plan
                res = e.cancel(rid)
                run.cancels[rid] = Cancel(rid, res.outcome, res.emitted,
                                          plan.index if plan else e.scheduler.step_index, plan is not None)

    def stepper():
        while not done.is_set():
            if e.scheduler.has_work:
                e.step()
            elif submitted.is_set():
                return
            else:
                time.sleep(0.0005)

    threads = [threading.Thread(target=guard(f), name=f.__name__) for f in (stepper, submitter, canceller)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(timeout=120)
    threads[0].join(timeout=120)
    done.set()
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return e, run


def problems(e: Engine, run: Run, clean: dict) -> list[str]:
    """Every way the run broke the contract, in words."""
    out = list(run.errors)
    if e.pool.owned or e.pool.num_free != e.pool.capacity:
        out.append(f"pages leaked: owned {e.pool.owned}, {e.pool.num_free} of {e.pool.capacity} free")
    e.pool.check()
    for rid, r in e.requests.items():
        c = run.cancels.get(rid)
        if c is None or c.outcome != "cancelled":        # a survivor (a cancel after it finished is a no-op)
            if r.state is not State.FINISHED or r.output != clean[rid]:
                out.append(f"{rid}: survivor {r.state.value} with {r.output}, clean run {clean[rid]}")
            continue
        if r.state is not State.CANCELLED:
            out.append(f"{rid}: cancelled (with {c.emitted} tokens) but ended {r.state.value} with {len(r.output)}")
        if len(r.output) != c.emitted:
            out.append(f"{rid}: {len(r.output) - c.emitted} token(s) after its cancel (cancelled with "
                       f"{c.emitted}, ended with {len(r.output)}; token steps {r.token_steps}, cancel due at step "
                       f"{c.due})")
        if r.output != clean[rid][:len(r.output)]:
            out.append(f"{rid}: cancelled, its tokens {r.output} are not a prefix of the clean run's {clean[rid]}")
        if r.admit_step is not None and run.released.get(rid) != c.due:
            out.append(f"{rid}: cancelled {'during' if c.mid_step else 'before'} step {c.due}, pages released at "
                       f"step {run.released.get(rid)}")
    return out


def test_submit_and_cancel_from_other_threads_while_one_steps(loaded, clean):
    e, run = threaded_run(loaded)
    assert not problems(e, run, clean), "\n".join(problems(e, run, clean))
    cancelled = [c for c in run.cancels.values() if c.outcome == "cancelled"]
    mid = [c for c in cancelled if c.mid_step]
    running = [c for c in cancelled if c.emitted > 0 or c.rid in run.released]
    print(f"\n{len(e.requests)} requests, {len(cancelled)} cancelled ({len(mid)} during a step, {len(running)} "
          f"after admission), {len(e.trace)} steps")
    # the run must have exercised what it checks: cancels during a forward, of admitted requests, and survivors
    assert len(mid) >= 3 and len(running) >= 3 and len(cancelled) < len(e.requests) - 5, \
        (len(mid), len(running), len(cancelled))


def test_planted_emit_after_cancel_is_caught(loaded, clean, monkeypatch):
    """main's Request.emit: a token computed by a step that a cancel landed in overwrote the cancelled state."""
    real = Request.emit

    def emit(self, token, step, t):
        if self.state is State.CANCELLED:
            self.state = State.DECODE       # the token overwrites the cancel
        return real(self, token, step, t)
    monkeypatch.setattr(Request, "emit", emit)
    e, run = threaded_run(loaded)
    found = problems(e, run, clean)
    assert any("token(s) after its cancel" in p or "but ended" in p for p in found), found
