"""The engine: submit requests, step, run to completion, read results and the per-step trace. What it serves is
decided at construction in engine/served.py; its checks of a step launched ahead are in engine/foresight.py; its
request side (submit, cancel, pop_result, results, the input checks) in engine/intake.py."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from . import build_cost, errors, foresight
from .config import EngineConfig
from .dtypes import torch_dtype
from .heap import gc_frozen
from .intake import RequestIntake
from .loader import load_model
from .poison_report import poison_error
from .pool import PagePool
from .request import Request
from .runner import ModelRunner, build_runner
from .schedule_log import ScheduleLog
from .scheduler import Chunk, Foresight, ScheduleMark, Scheduler, StepKind, StepPlan
from .served import check_max_model_len, check_record_topk, pool_pages, use_cuda_graphs, use_overlap
from .sigint import HeldSigint
from .workload import RequestSpec

# The pool owner of Engine.score's pages: a tuple, so that no request id (always a string) can be the same owner.
SCORE_OWNER = ("score",)

# The points of a step at which Engine calls its step_hook (a test seam: tests/test_step_atomic.py raises at each).
# An exception at one of the first four undoes the step, and the next step() redoes it; at one of the next three it
# stops the step's commit half-way, so the engine fails (EngineDeadError); at the last the step stands.
STEP_POINTS = ("scheduled", "launched", "launched-ahead", "read-back", "applied", "finished", "traced", "poisoned")


@dataclass
class StepRecord:
    """One line of the per-step trace."""
    index: int
    kind: StepKind
    prompt_positions: int
    decode_tokens: int
    chunks: int
    admitted: int
    start: float              # seconds since the engine's clock started
    duration: float           # seconds (device synchronised around the step when sync_trace is on)
    admission_blocked: bool = False   # the queue's head waited for pages while a row was free
    withheld: int = 0         # long prompts whose next prompt chunk waited for the decoders (prefill share)
    ahead: bool = False       # the step was launched ahead, during the step before (EngineConfig.overlap)


class Engine(RequestIntake):
    """Submit requests, step, read or pop results.

    Threads: submit(), cancel(), pop_result() and results() may be called from any thread, also while another
    thread steps; step() and score() run one at a time (a second caller waits). A step holds the bookkeeping lock
    while it schedules and while it books its tokens, not during its forward: a request submitted during a forward
    waits for the next step; a cancel during a forward takes effect at the end of that step (no token after it,
    pages released there). Fields read directly (requests, trace, pool, scheduler) are consistent only between
    steps, or under `engine.lock`."""

    def __init__(self, config: EngineConfig = EngineConfig(), model=None, *, loaded=None,
                 schedule_log: ScheduleLog | None = None, pool_cls=PagePool, scheduler_cls=Scheduler,
                 runner_cls=ModelRunner,
                 step_hook: Callable[[str], None] | None = None):
        """`model`: a checkpoint directory, an in-memory transformers model, "qwen2.5-1.5b-random", or None for the
        small model. `loaded`: an already loaded (model, hf_config, name), to share weights between engines.
        `schedule_log`: where the scheduler records every admission, release and step end, for a check of the whole
        run (gates/schedule_check.py: pass ScheduleLog()); None: nothing is recorded, so memory stays flat.
        `pool_cls`, `scheduler_cls`, `runner_cls`: the engine's parts (the gates' planted pools, schedulers and
        runners come in here, at construction, never patched in afterwards; tp > 1 runs engine.tp's runner). `step_hook`: called with each of STEP_POINTS as a step
        passes it (a test seam; None: nothing is called)."""
        self.config = config
        dtype = torch_dtype(config.dtype)
        self.model, self.hf_config, self.model_name = loaded or load_model(model, dtype, config.device)
        built_from = time.perf_counter()        # the build's cost past the model's load (engine/build_cost.py)
        self.shape = self.model.shape
        self.max_model_len = min(config.max_model_len or self.shape.max_positions, self.shape.max_positions)
        # checks tp against the model's heads first
        num_pages = pool_pages(config, self.shape, self.max_model_len, dtype)
        check_record_topk(config, self.shape)
        self.pool = pool_cls(num_pages, config.page_size, prefix_cache=config.prefix_cache)
        check_max_model_len(config, self.pool, self.max_model_len, num_pages)
        self.scheduler = scheduler_cls.from_config(self.pool, config, schedule_log)
        max_kv = min(self.max_model_len, self.pool.capacity * config.page_size)
        width = self.pool.pages_needed(self.max_model_len)
        if config.tp == 1:
            self.runner = build_runner(self.model, config, dtype, num_pages, max_kv, width,
                                       graphs=self.use_cuda_graphs(config), runner_cls=runner_cls)
        else:
            from .tp.runner import TPRunner
            # workers load a named model themselves; an in-memory one reaches them as shards from rank 0
            self.runner = TPRunner.start(config.with_(cuda_graphs=self.use_cuda_graphs(config)), self.model, dtype,
                                         num_pages, max_kv, width,
                                         source=(model or "small") if loaded is None else None)
        try:
            self.overlap = use_overlap(config, self.runner)
        except errors.ConfigError:
            self.runner.close()         # workers already started (tp > 1) stop with the refusal
            raise
        # what this engine serves: every None of the config decided (golden meta, the gate summary, bench rows)
        self.served = config.resolved(graphs=self.runner.graphs is not None, overlap=self.overlap).with_(
            num_pages=num_pages, max_model_len=self.max_model_len)
        self.build_cost = build_cost.record(self.served.key(), getattr(self.runner, "build_cost", {}),
                                            time.perf_counter() - built_from)    # tp > 1: no runner of its own
        self._ahead: tuple[Foresight, object] | None = None   # the step launched ahead, its samples
        self.steps_ahead = 0            # steps that ran as launched ahead (their rows foreseen)
        self.ahead_discarded = 0        # steps launched ahead and dropped: the real schedule did not match their
        # rows, or the step they were launched on was undone
        self.steps_undone = 0           # steps an exception interrupted before their commit (redone by the next step)
        self.requests: dict[str, Request] = {}   # until pop_result()
        self.topk: dict[str, list[tuple[list[int], list[float]]]] = {}   # record mode: per emitted token
        self.trace: list[StepRecord] = []       # the last config.trace_limit steps (all with None)
        self.lock = threading.RLock()           # every bookkeeping change: requests, scheduler, pool, trace
        self._sigint = HeldSigint()             # Ctrl-C held over each block of bookkeeping (engine/sigint.py)
        self._stepping = threading.RLock()      # one step (or score) at a time: they share the runner
        self.t0 = time.perf_counter()
        self._auto_id = 0
        self.hook = step_hook or (lambda point: None)
        # the step between its schedule and its commit: (plan, what its schedule changed, the pages it evicted),
        # undone by the next step() if an exception left it open
        self._open: tuple[StepPlan, ScheduleMark, list[int]] | None = None
        self._unpoisoned: list[int] = []    # pages freed by the last step, poisoned after its commit
        self._poisoned_ahead = False        # the open step's freed pages were poisoned for the step launched ahead
        self._dead: errors.EngineDeadError | None = None   # the first failure that left the state untrusted

    # asked of Engine, not of engine/served.py: the gates ask whether an engine captures its steps here, and tests
    # swap the answer (tests/conftest.py forces the captured steps' path on a CPU)
    use_cuda_graphs = staticmethod(use_cuda_graphs)

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker ranks (tp > 1; also at exit, or when the engine is collected). Results and the trace
        stay readable. Nothing to stop at tp 1."""
        self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- failure ---------------------------------------------------------------------------------------------
    def alive(self) -> None:
        """Raise EngineDeadError if a failure has left the engine's state untrusted; every public call but close()
        checks this first, so that nothing is served from that state."""
        dead = self._dead
        if dead is not None:    # a new error each time: raising one instance again would grow its traceback
            raise errors.EngineDeadError(str(dead), dead.cause, dead.step) from dead.cause

    def _fail(self, what: str, cause: BaseException) -> None:
        """Mark the engine failed: `cause` stopped it while `what`. The first failure is the one named."""
        if self._dead is None:
            step = self.scheduler.step_index
            self._dead = errors.EngineDeadError(
                f"the engine failed at step {step} {what}: {type(cause).__name__}: {cause}; its state cannot be "
                f"trusted, so it serves nothing more: make a new engine", cause, step)
            cause.add_note("the engine is failed: every later call raises EngineDeadError")

    @contextmanager
    def _bookkeeping(self, what: str):
        """A block of the step's bookkeeping, all or nothing: under the lock, with Ctrl-C held to its end. It calls
        no device, so an exception out of it is a bug that may have stopped it half-way: the engine fails."""
        with self.lock, self._sigint:
            try:
                yield
            except BaseException as e:
                self._fail(what, e)
                raise

    def _recover(self) -> None:
        """Before a step (or score): finish what an exception interrupted after the last one. A step still open
        failed before its commit and is undone (so it is redone now); pages it freed are poisoned."""
        if self._open is not None:
            with self._bookkeeping("while undoing a step"):
                self._undo()
        if self._unpoisoned:
            self.runner.poison_pages(self._unpoisoned)
            self._unpoisoned = []

    def _undo(self, cause: BaseException | None = None) -> None:
        """Undo the open step's schedule (under the lock): the bookkeeping is as before it; the step launched ahead
        on its samples is dropped. Its forward wrote only the open step's own slots: written again by the redo before
        anything reads them, or, for pages that go back to the pool, poisoned before the next forward."""
        plan, mark, evicted = self._open
        self.steps_undone += 1
        self.ahead_discarded += self._ahead is not None     # its forward ran: counted as dropped, as a missed one
        self._ahead = None
        self.scheduler.undo(plan, mark, evicted)
        for r in plan.admitted:
            r.admit_time = None
        self._open = None
        if self._poisoned_ahead:
            # the pages of requests this step finishes were poisoned for the step launched after it; the redo
            # would read them
            self._fail("after poisoning the pages it frees (poison mode, a step launched ahead), so it cannot be "
                       "redone", cause or RuntimeError("the step was interrupted before its commit"))

    # -- clock -----------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.t0

    def reset_clock(self) -> None:
        self.t0 = time.perf_counter()

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    # -- the step --------------------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """One step. One thread steps at a time (a second waits); the forward runs without the bookkeeping lock, so
        submit and cancel from other threads do not wait for it.
        All or nothing: an exception before the step's commit (in its forward or readback, Ctrl-C included) leaves
        the engine as before the step, and the next step() redoes it; the commit holds Ctrl-C until it ends; an
        exception that stops the commit half-way fails the engine (EngineDeadError from every later call)."""
        with self._stepping:
            self.alive()
            self._recover()
            return self._step()

    def _step(self) -> StepRecord:
        cfg = self.config
        ahead, self._ahead = self._ahead, None
        if cfg.sync_trace and ahead is None:
            self._sync()
        with self._bookkeeping("while scheduling"):
            start = self.now()
            mark = self.scheduler.mark()
            plan = self.scheduler.schedule()
            # cached pages evicted to admit this step's requests: NaN before their new owners write them
            evicted = self.pool.take_evicted()
            self._open, self._poisoned_ahead = (plan, mark, evicted), False
            for r in plan.admitted:
                r.admit_time = start
            blocked = self.scheduler.row_free_for_head()
            # the forward's own view: a submit or cancel during it changes no page of the plan's requests
            pages_of = dict(self.pool.owned)
        try:
            out, ran_ahead = self._forward(plan, ahead, evicted, pages_of)
        except BaseException as e:
            with self._bookkeeping("while undoing a step"):
                self._undo(e)
            raise
        with self._bookkeeping("while committing a step"):
            end = self.now()
            if out is not None:
                sampled = plan.sampled
                if cfg.poison and any(out.nonfinite):
                    if self._ahead is not None:         # the report re-runs this step: nothing may be in flight
                        self._sync()
                        self._ahead = None
                    err = poison_error(self, plan, sampled, out.nonfinite)   # reads the cache as the step left it
                    self.scheduler.finish_step()   # keep the pool consistent for the report's readers
                    raise err                      # the step is lost half-way: the engine fails (_bookkeeping)
                # a request cancelled during the forward emits nothing
                emitted = plan.apply(out.tokens, end)
                self.hook("applied")
                if out.topk_ids:                    # record mode
                    emitted = {id(r) for r in emitted}
                    for r, ids, vals in zip(sampled, out.topk_ids, out.topk_vals):
                        if id(r) in emitted:
                            self.topk.setdefault(r.request_id, []).append((ids, vals))
            # the step's time feeds the prefill-share debt
            self._unpoisoned = self.scheduler.finish_step(duration=end - start)
            self._open = None
            self.hook("finished")
            self.steps_ahead += ran_ahead
            self.ahead_discarded += ahead is not None and not ran_ahead
            rec = StepRecord(plan.index, plan.kind, plan.prompt_positions, len(plan.decodes), len(plan.chunks),
                             len(plan.admitted), start, end - start, blocked, plan.withheld, ran_ahead)
            self.trace.append(rec)
            if cfg.trace_limit is not None and len(self.trace) > cfg.trace_limit:
                del self.trace[:len(self.trace) - cfg.trace_limit]
            self.hook("traced")
        # no step can admit into them before this: one thread steps at a time (and the next one poisons them first if
        # an exception stops this)
        self.runner.poison_pages(self._unpoisoned)
        self._unpoisoned = []
        self.hook("poisoned")
        return rec

    def _forward(self, plan: StepPlan, ahead, evicted: list[int], pages_of) -> tuple[object, bool]:
        """The step's forward and readback, and the launch of the step after it: (its sampled rows, whether it was
        the step launched ahead). Changes no bookkeeping, so that an exception here is undone by undoing the
        schedule (Engine._undo)."""
        cfg = self.config
        self.hook("scheduled")
        ran_ahead = ahead is not None and self.matches(ahead[0], plan)
        if ran_ahead:
            pending = ahead[1]          # launched during the step before, on the rows this schedule chose
        else:
            # a submit or cancel since the step was foreseen: that launch wrote only its requests' own next slots
            # (each decode row's next position, each chunk's positions), which a request writes again before it
            # reads them (or, cancelled, never reads); its samples are dropped
            self.runner.poison_pages(evicted)
            pending = self.runner.launch(plan, pages_of, cfg.forward) if not plan.empty else None
        self.hook("launched")
        if pending is not None and self.overlap:
            # launch the next step, if it can be foreseen, before reading this one back: the device goes from this
            # step to the next without waiting for this step's readback, bookkeeping and the next one's packing
            with self.lock:
                step = self.scheduler.next_step(plan)
                # poison mode: the pages this step frees are poisoned before the step launched after it, as they
                # would be between two serial steps, so that a step launched ahead that reads one is caught
                freeing = self.pages_freed_by(plan) if cfg.poison and step is not None else []
            self._poisoned_ahead = bool(freeing)
            self.runner.poison_pages(freeing)
            launched = self.runner.launch_ahead(step, pages_of, pending, cfg.forward) if step is not None else None
            if launched is not None:
                self._ahead = (step, launched)
                self.hook("launched-ahead")
        out = pending.result() if pending is not None else None
        self.hook("read-back")
        if cfg.sync_trace and self._ahead is None:
            self._sync()
        return out, ran_ahead

    # tests swap these two on Engine (tests/test_overlap.py): a launch ahead taken for any plan, a foresight that
    # misses the freed pages
    matches = staticmethod(foresight.matches)

    def pages_freed_by(self, plan: StepPlan) -> list[int]:
        """The pages that the end of `plan`'s step will free (engine/foresight.py)."""
        return foresight.pages_freed_by(self.scheduler, plan)

    # -- running ---------------------------------------------------------------------------------------------
    def run(self, specs: list[RequestSpec] | None = None, open_loop: bool = False, progress=None,
            until=None) -> dict:
        """Serve `specs` (and whatever is queued) to completion. open_loop: deliver each request at its
        arrival_time on the engine's clock, while the engine works; otherwise all arrive now. until(engine): checked
        before each step; once true, return and leave what is queued or running as it is. The run holds
        gc_frozen(): no full garbage collection of what was alive before it lands between its steps."""
        self.alive()
        with gc_frozen(), self._sigint.installed():     # Ctrl-C's handler in once, not swapped twice a step
            return self._run(specs, open_loop, progress, until)

    def _run(self, specs, open_loop, progress, until) -> dict:
        pending = sorted(specs or [], key=lambda s: s.arrival_time)
        if not open_loop:
            for s in pending:
                self.submit(s.prompt, s.budget, s.request_id, self.now())
            pending = []
        i = 0
        while i < len(pending) or self.scheduler.has_work:
            now = self.now()
            while i < len(pending) and pending[i].arrival_time <= now:
                s = pending[i]
                self.submit(s.prompt, s.budget, s.request_id, s.arrival_time)
                i += 1
            if until is not None and until(self):
                break
            if not self.scheduler.has_work:
                time.sleep(max(0.0, min(pending[i].arrival_time - now, 0.01)))
                continue
            rec = self.step()
            if progress is not None:
                progress(rec)
        return self.results()

    # -- teacher forcing -------------------------------------------------------------------------------------
    def score(self, tokens: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits [len(tokens), vocab] at every position of `tokens` ([1, vocab]: the last position's, with
        `last_only`), in one forward over the paged cache. Bad tokens raise the RequestError that submit() would
        (nothing changes); a pool whose free pages cannot hold them now, because requests being served hold the
        rest, raises NoRoomError: steps free pages, so call again after some (a wait here would wait forever, since
        no step runs while score() holds the runner)."""
        self.alive()
        tokens = self.token_ids(tokens, "score")
        if len(tokens) > self.max_model_len:
            raise errors.ExceedsMaxPositionsError(
                f"score: {len(tokens)} positions exceed the max positions served ({self.max_model_len}; the "
                f"model's: {self.shape.max_positions})")
        self.pool.check_fits("score", len(tokens), 0)
        with self._stepping:
            self.alive()
            self._recover()
            with self.lock:
                if not self.pool.can_reserve(len(tokens)):
                    raise errors.NoRoomError(
                        f"score: {len(tokens)} positions need {self.pool.pages_needed(len(tokens))} pages of "
                        f"{self.pool.page_size} slots, {self.pool.num_free} of {self.pool.capacity} are free now "
                        f"(the rest are held by requests being served): call again after a step frees pages")
                self.pool.reserve(SCORE_OWNER, len(tokens))
                pages = self.pool.owned[SCORE_OWNER]
                evicted = self.pool.take_evicted()
            self.runner.poison_pages(evicted)
            try:
                return self.runner.score(Chunk(Request(SCORE_OWNER, tokens, 1), 0, len(tokens)), pages,
                                         last_only)
            finally:
                with self.lock:
                    self.pool.release(SCORE_OWNER)
                    self.scheduler.log.scored(self.scheduler.step_index, SCORE_OWNER, pages)
                    freed = [] if self.pool.in_step else self.pool.end_step()
                self.runner.poison_pages(freed)
