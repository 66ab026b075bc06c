"""Planted bugs, one name each: the planted-bug tests patch them in one at a time, and a whole gate run takes one
for the session as a pytest plugin:

    python -m pytest gates/ -p tests.plants --plant NAME -x [--plant-record FILE]

`--plant-record FILE` writes the first failing report (node id, wall clock and CPU seconds, message) as JSON, for
scripts/plant_table.py. Each plant carries what the failure message must match to name its cause."""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Callable

import pytest

from engine.pool import PagePool
from engine.scheduler import Scheduler


# -- pool and scheduler plants (subclasses: the hypothesis gate runs its machine over them) -------------------------
class FlooringPool(PagePool):
    """A reservation rounded down instead of up."""

    def pages_needed(self, slots: int) -> int:
        return slots // self.page_size


class AcceptingPool(PagePool):
    """The never-fits rule lost: a request larger than the whole pool is accepted and would wait forever."""

    def check_fits(self, request_id: str, prompt_len: int, budget: int) -> None:
        pass


class QueueJumpingScheduler(Scheduler):
    """Admission lets a later short request jump the queue: any waiting request that fits, not only the head."""

    def admit(self):
        admitted = []
        for r in list(self.waiting):
            hits = self.kv.hits(r)
            if len(self.running) < self.max_batch and self.kv.can_admit(r, hits):
                self.waiting.remove(r)
                self.admit_one(r, hits)
                admitted.append(r)
        return admitted


class SkippingArrivalsScheduler(Scheduler):
    """Arrival indices counted two by two (0, 2, 4, ...): still in submit order, so strict FCFS orders them right,
    but they no longer count the submits (session 18's scheduler survivor `next_arrival += 2`)."""

    def add(self, request):
        super().add(request)
        self.next_arrival += 1


class EagerFreePool(PagePool):
    """Pages freed during the step instead of at its end: release() puts them straight back on the free list."""

    def release(self, owner: str) -> None:
        pages = self.owned.pop(owner)
        for p in pages:    # counts dropped with them: the bug is the timing, not a count left behind
            self.refs.pop(p, None)
        self.free.extend(pages)


class SharedListsPool(PagePool):
    """A copy of the pool (engine/copying.py's, which poison mode's foresight of the freed pages runs a step's end on)
    that shares its free list and ownership map with the pool: the foresight's step end then frees the real pool's
    pages, and the real step end finds them gone."""

    def __deepcopy__(self, memo):
        import copy
        new = copy.copy(self)
        memo[id(self)] = new
        new.pending, new.refs = list(self.pending), dict(self.refs)
        return new


class OverfullScheduler(Scheduler):
    """Admission beyond max_batch: the row check is off by one."""

    def admit(self):
        self.max_batch += 1
        try:
            return super().admit()
        finally:
            self.max_batch -= 1


# -- patches: each takes a pytest.MonkeyPatch (a test's `monkeypatch`, or the session's in the plugin) -------------
def after_build(mp: pytest.MonkeyPatch, change: Callable) -> None:
    """ModelRunner.build, then `change(runner, chunks, positions, ctx)` on what it built."""
    from engine.runner import ModelRunner
    build = ModelRunner.build

    def bugged(self, chunks, *args, **kwargs):
        tokens, positions, ctx, rows = build(self, chunks, *args, **kwargs)
        change(self, chunks, positions, ctx)
        return tokens, positions, ctx, rows

    mp.setattr(ModelRunner, "build", bugged)


def rotary(mp: pytest.MonkeyPatch) -> None:
    """Decode rows rotated as if one position later."""
    def change(runner, chunks, positions, ctx):
        positions[ctx.num_prefill:] += 1
    after_build(mp, change)


def cache_len(mp: pytest.MonkeyPatch) -> None:
    """Decode attends to one slot fewer than its history."""
    def change(runner, chunks, positions, ctx):
        if ctx.decode is not None:
            ctx.decode.kv_lens = [n - 1 for n in ctx.decode.kv_lens]
            ctx.decode.kv_lens_t -= 1
            runner.backend.prepare(ctx.decode, "decode")
    after_build(mp, change)


def chunk_position(mp: pytest.MonkeyPatch) -> None:
    """Every prompt chunk but a prompt's first, one position late."""
    def change(runner, chunks, positions, ctx):
        i = 0
        for c in chunks:
            if c.start > 0:
                positions[i:i + c.length] += 1
            i += c.length
    after_build(mp, change)


def token_choice(mp: pytest.MonkeyPatch) -> None:
    """Every decode row takes its runner-up (completing prompt chunks keep their first choice)."""
    import torch
    from engine.runner import ModelRunner
    launch = ModelRunner.launch

    def bugged(self, plan, pages_of, forward_mode, use_graphs=True):
        first = sum(c.completes_prompt for c in plan.chunks)     # decode rows come after completing chunks
        sample = self.sample_async

        def runner_up(logits):
            logits = logits.clone()
            rows = torch.arange(first, logits.shape[0])
            second = logits[first:].topk(2).indices[:, 1]
            logits[rows, second] = logits[first:].max(-1).values + 0.5
            return sample(logits)

        self.sample_async = runner_up
        try:
            return launch(self, plan, pages_of, forward_mode, use_graphs)
        finally:
            del self.sample_async

    mp.setattr(ModelRunner, "launch", bugged)


def decode_tables(mp: pytest.MonkeyPatch, change: Callable, kv_change: Callable | None = None) -> None:
    """The decode batch's block-table rows through `change(tables)` (and its lengths through `kv_change`)."""
    from engine.runner import ModelRunner
    attn = ModelRunner._attn_batch

    def bugged(self, q_lens, kv_lens, tables):
        if all(n == 1 for n in q_lens):
            tables = change(tables)
            kv_lens = kv_change(kv_lens) if kv_change else kv_lens
        return attn(self, q_lens, kv_lens, tables)

    mp.setattr(ModelRunner, "_attn_batch", bugged)


def ahead_tokens(mp: pytest.MonkeyPatch) -> None:
    """A pure decode step launched ahead (EngineConfig.overlap) gathers each row's input token from the next row's
    sample: the bug is only in the launched-ahead path (engine/graphs.py's gather of the step before's samples)."""
    import engine.graphs

    def shifted(tokens, source):
        tokens.copy_(source.index_select(0, (tokens + 1) % source.shape[0]))
    mp.setattr(engine.graphs, "gather_tokens", shifted)


def append_value(mp: pytest.MonkeyPatch) -> None:
    """The Triton decode's fused append attends to each row's own value 1% too large (as if read wrong from
    registers), while the cache gets the right one: only the step's own key/value pair is off, and only in pure
    decode steps on the flash backend (CUDA). The token gates' 0.02 rule absorbs it on the small model."""
    import torch

    import kernels.triton_decode as td
    decode = td.paged_decode

    def planted(q, k_cache, v_cache, block_table, cached, scale, new_kv=None, **kw):
        if new_kv is None:
            return decode(q, k_cache, v_cache, block_table, cached, scale, **kw)
        k, v = new_kv
        out = decode(q, k_cache, v_cache, block_table, cached, scale, (k, v * 1.01), **kw)
        ps = k_cache.shape[1]
        rows = torch.arange(cached.shape[0], device=cached.device)
        slots = block_table[rows, (cached // ps).long()].long() * ps + (cached % ps).long()
        v_cache.view(-1, *v.shape[1:])[slots] = v        # the right value in the cache: the bug is the attended one
        return out
    mp.setattr(td, "paged_decode", planted)


def mlp_up_row(mp: pytest.MonkeyPatch) -> None:
    """The fused MLP kernel's up half read one weight row late (column j multiplies row N + j + 1), as an
    off-by-one in its up offset would: every CUDA step of at most 32 positions computes a wrong MLP."""
    import torch

    import kernels.mlp as mlp
    fused = mlp.gate_up_silu

    def planted(x, w, out=None):
        n = w.shape[0] // 2
        return fused(x, torch.cat([w[:n], w[n + 1:], w[-1:]]), out)
    mp.setattr(mlp, "gate_up_silu", planted)


def mlp_never_fused(mp: pytest.MonkeyPatch) -> None:
    """The MLP's choice ignores the forward's context: every MLP takes torch's kernels where the fused one is
    configured (CUDA). The tokens agree within the tie rule; the served record names the configuration only."""
    from engine.model import ForwardContext

    def torch_only(self, rows):
        if self.mlp_took is not None:
            self.mlp_took.add((rows, "torch"))
        return False
    mp.setattr(ForwardContext, "fuses_mlp", torch_only)


def pdl_no_wait(mp: pytest.MonkeyPatch) -> None:
    """The Triton decode's kernels, launched with PDL, never wait for the kernel before them (its wait_for_prior is
    launch_dependents, a kernel's other PDL call): the combine reads the partial outputs while attend_items still
    writes them. Only where PDL runs (the PDL gate's run; CUDA)."""
    from kernels import pdl_kernels, triton_decode_kernels
    mp.setattr(triton_decode_kernels, "wait_for_prior", pdl_kernels.launch_dependents)


def linear_bias_late(mp: pytest.MonkeyPatch) -> None:
    """The split-K linear kernel adds each column the next column's bias (column j gets bias j + 1), as an
    off-by-one in its bias offset would: q/k/v of every CUDA step of at most 32 positions would be wrong where the
    kernel is configured, and the kernel gate checks it whether or not it is."""
    import torch

    import kernels.linear as linear
    kernel = linear.splitk_linear

    def planted(x, w, bias=None, out=None, **kw):
        return kernel(x, w, None if bias is None else torch.cat([bias[1:], bias[-1:]]), out, **kw)
    mp.setattr(linear, "splitk_linear", planted)


def registry_gap(mp: pytest.MonkeyPatch) -> None:
    """The kernel registry loses one path: the torch backend no longer declares its decode kernel, so the kernel
    gate (whose cases come from the registry) never checks it, while every engine still decodes with it."""
    from kernels.torch_backend import TorchBackend
    declared = TorchBackend.declared_paths.__func__
    mp.setattr(TorchBackend, "declared_paths",
               classmethod(lambda cls: [p for p in declared(cls) if p.name != "torch.decode.gather"]))


def decode_via_prefill(mp: pytest.MonkeyPatch) -> None:
    """The torch backend's decode calls routed through its prefill call (same gather kernel, same values): the
    configuration names a decode kernel that no call dispatches to."""
    from kernels.torch_backend import TorchBackend

    def decode(self, q, k_cache, v_cache, batch, scale):
        batch.prepared["prefill"] = batch.prepared["decode"]
        return self.prefill(q, k_cache, v_cache, batch, scale)
    mp.setattr(TorchBackend, "decode", decode)


def no_static_steps(mp: pytest.MonkeyPatch) -> None:
    """The torch backend no longer declares its kernels right over the captured steps' static buffers: on a CPU the
    smoke gates over steps launched ahead would skip."""
    from kernels.torch_backend import TorchBackend
    mp.setattr(TorchBackend, "static_steps", False)


def prefix_default_off(mp: pytest.MonkeyPatch) -> None:
    """The prefix cache switched off where a configuration's defaults are decided: the smoke prompts share no page,
    so every token is the same; only what is served differs."""
    from dataclasses import replace
    from engine.config import EngineConfig
    resolved = EngineConfig.resolved
    mp.setattr(EngineConfig, "resolved", lambda self, *a, **kw: replace(resolved(self, *a, **kw), prefix_cache=False))


def schedule_log_kept(mp: pytest.MonkeyPatch) -> None:
    """A scheduler built without a schedule log keeps one whole (as the survivor `ScheduleLog(keep=True)` did): every
    gate asks for the log, so only a served engine's memory grows."""
    import engine.scheduler
    from engine.schedule_log import ScheduleLog
    mp.setattr(engine.scheduler, "ScheduleLog", lambda keep=True: ScheduleLog(keep=True))


def chunk_default_513(mp: pytest.MonkeyPatch) -> None:
    """The fused engine's default chunk budget one position larger (as a mutant of CHUNK_TOKENS did): every gate
    runs its workload's own budget, so only a user who passes nothing gets it."""
    from engine.config import LINEAGE
    mp.setitem(LINEAGE["fused"], "chunk_tokens", 513)


def stale_read(mp: pytest.MonkeyPatch) -> None:
    """Decode row i reads its history through row i-1's block-table row: another request's pages."""
    decode_tables(mp, lambda tables: tables[:1] + tables[:-1] if len(tables) >= 2 else tables)


def stale_row_cache(mp: pytest.MonkeyPatch) -> None:
    """Decode rows keep the block table of the first request they served: once it finishes, the request that
    moves up to its row reads its freed, poisoned pages."""
    stale: dict[int, list[int]] = {}
    decode_tables(mp, lambda tables: [stale.setdefault(i, t) for i, t in enumerate(tables)])


def decode_one_past(mp: pytest.MonkeyPatch) -> None:
    """Each decode row attends to one slot past its length: its own never-written slot."""
    decode_tables(mp, lambda tables: tables, lambda kv_lens: [n + 1 for n in kv_lens])


def read_past_length(mp: pytest.MonkeyPatch) -> None:
    """The torch kernels gather one slot past each sequence's length; the mask still hides it, so only poisoning
    can catch the read itself (0 * NaN = NaN)."""
    import torch
    from kernels import torch_backend
    from kernels.torch_backend import TorchBackend
    gather = torch_backend.gather_slots

    def one_past(block_tables, kv_lens, max_kv, page_size):
        return gather(block_tables, kv_lens + 1, max_kv + 1, page_size)

    mp.setattr(torch_backend, "gather_slots", one_past)
    prepare = TorchBackend.prepare

    def padded_mask(self, batch, kind):
        prepare(self, batch, kind)
        batch.prepared[kind] = [(rows, slots, torch.nn.functional.pad(mask, (0, 1)), s, i)
                                for rows, slots, mask, s, i in batch.prepared[kind]]

    mp.setattr(TorchBackend, "prepare", padded_mask)


def fcfs(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(Scheduler, "admit", QueueJumpingScheduler.admit)


def eager_free(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(PagePool, "release", EagerFreePool.release)


def undo_drops_a_row(mp: pytest.MonkeyPatch) -> None:
    undo = Scheduler.undo

    def planted(self, plan, mark, evicted):
        undo(self, plan, mark, evicted)
        if plan.admitted and self.running:
            self.running.pop()      # one row too many given back: a request admitted earlier is lost with its pages
    mp.setattr(Scheduler, "undo", planted)


def vocab_check_lost(mp: pytest.MonkeyPatch) -> None:
    """submit() no longer checks that a prompt's tokens are inside the vocabulary (a refactor of the input checks
    that kept the empty prompt's): the engine queues the request, and its embedding reads past the table (on CUDA a
    device-side assert, which ends every request the process serves)."""
    from engine import errors, inputs
    from engine.intake import RequestIntake

    def token_ids(self, prompt, who: str) -> list[int]:
        tokens = inputs.prompt_of(prompt, who)
        if not tokens:
            raise errors.EmptyPromptError(f"{who}: empty prompt")
        return tokens
    mp.setattr(RequestIntake, "token_ids", token_ids)


def fits_check_lost(mp: pytest.MonkeyPatch) -> None:
    """submit() no longer asks the pool whether the request could ever fit it (the pool's own rule is intact, and
    the admission machine, which calls it directly, passes): a request larger than the pool waits forever."""
    from engine import errors, inputs
    from engine.intake import RequestIntake

    def validate(self, prompt, budget, request_id):
        tokens = self.token_ids(prompt, request_id)
        budget = inputs.budget_of(budget, request_id)
        if len(tokens) + budget > self.max_model_len:
            raise errors.ExceedsMaxPositionsError(f"{request_id}: exceeds the max positions served")
        return tokens, budget
    mp.setattr(RequestIntake, "validate", validate)


def refused_id_kept(mp: pytest.MonkeyPatch) -> None:
    """submit() records a request's id before its checks and leaves it when it refuses the request: the id is
    taken until popped, and results() lists a request that was never queued."""
    from engine import errors, inputs
    from engine.intake import RequestIntake
    from engine.request import Request
    submit = RequestIntake.submit

    def planted(self, prompt, budget, request_id=None, arrival_time=None):
        try:
            return submit(self, prompt, budget, request_id, arrival_time)
        except errors.RequestError:
            try:
                rid = inputs.request_id_of(request_id)
            except errors.RequestError:
                raise
            self.requests.setdefault(rid, Request(rid, [0], 1, self.now()))
            raise
    mp.setattr(RequestIntake, "submit", planted)


def pop_keeps_topk(mp: pytest.MonkeyPatch) -> None:
    """pop_result() forgets the request but keeps its top-k records: in record mode a server's memory grows by every
    request it ever served."""
    from engine.intake import RequestIntake
    pop = RequestIntake.pop_result

    def planted(self, request_id):
        kept = dict(self.topk)
        res = pop(self, request_id)
        self.topk.update(kept)
        return res
    mp.setattr(RequestIntake, "pop_result", planted)


def ahead_unpoisoned(mp: pytest.MonkeyPatch) -> None:
    """Poison mode no longer poisons the pages a step frees before the step launched after it (they are poisoned at
    the step's end, after that launch): a step launched ahead that read one would read stale values unseen."""
    from engine.engine import Engine
    mp.setattr(Engine, "pages_freed_by", lambda self, plan: [])


def trace_one_short(mp: pytest.MonkeyPatch) -> None:
    """An engine with trace_limit keeps one step fewer than asked."""
    from engine.engine import Engine
    step = Engine.step

    def planted(self):
        rec = step(self)
        limit = self.config.trace_limit
        if limit is not None and len(self.trace) >= limit:
            del self.trace[0]
        return rec
    mp.setattr(Engine, "step", planted)


def blocked_when_full(mp: pytest.MonkeyPatch) -> None:
    """A step records its admission as blocked for pages also when every row is held (session 28's engine survivor
    `<` -> `<=`: the tiny-pool gate asks only that some step was blocked)."""
    mp.setattr(Scheduler, "row_free_for_head", lambda self: bool(self.waiting) and len(self.running) <= self.max_batch)


def debt_time_doubled(mp: pytest.MonkeyPatch) -> None:
    """Each step's end gives the prefill-share debt twice the step's duration (session 29's engine sample survivor:
    `end + start` for `end - start`; tokens are identical at every share)."""
    finish = Scheduler.finish_step
    mp.setattr(Scheduler, "finish_step", lambda self, duration=None:
               finish(self, None if duration is None else 2 * duration))


def score_max_refused(mp: pytest.MonkeyPatch) -> None:
    """score() refuses a sequence of exactly the max positions (session 29's engine sample survivor: `>` -> `>=`;
    no gate scored a sequence that long)."""
    from engine.engine import Engine
    score = Engine.score

    def planted(self, tokens, last_only=False):
        if len(tokens) == self.max_model_len:
            from engine import errors
            raise errors.ExceedsMaxPositionsError(f"score: {len(tokens)} positions exceed the max positions served "
                                                  f"({self.max_model_len})")
        return score(self, tokens, last_only)
    mp.setattr(Engine, "score", planted)


def score_pool_budget(mp: pytest.MonkeyPatch) -> None:
    """score()'s pool check counts one position more than the sequence (session 29's engine sample survivor: budget
    0 -> 1): a score of exactly the whole pool is refused."""
    check = PagePool.check_fits
    mp.setattr(PagePool, "check_fits", lambda self, rid, prompt_len, budget:
               check(self, rid, prompt_len, budget + (rid == "score")))


def tp_workers_by_name(mp: pytest.MonkeyPatch) -> None:
    """At tp > 1 the worker ranks load the default model by name although the engine was given one (session 29's
    engine sample survivors: `if loaded is None` negated, twice): on the default model every token check passes."""
    from engine.tp.runner import TPRunner
    start = TPRunner.start.__func__
    mp.setattr(TPRunner, "start", classmethod(lambda cls, *args, source=None: start(cls, *args,
                                                                                     source=source or "small")))


def recover_skips_poison(mp: pytest.MonkeyPatch) -> None:
    """The next step does not poison the pages an interrupted poisoning left (session 30's engine survivor: `if not
    self._unpoisoned` in Engine._recover)."""
    from engine.engine import Engine
    mp.setattr(Engine, "_recover", lambda self: self._undo() if self._open is not None else None)


def refused_tp_keeps_workers(mp: pytest.MonkeyPatch) -> None:
    """A tp engine whose configuration is refused after its worker ranks started leaves them running (session 30's
    engine survivor: the `except errors.ConfigError` that closes the runner replaced): here its runner's close does
    nothing (the workers stop only when the runner is collected)."""
    from engine.tp.runner import TPRunner
    mp.setattr(TPRunner, "close", lambda self: None)


def loaded_anew(mp: pytest.MonkeyPatch) -> None:
    """An engine given loaded=(model, config, name) loads the default model itself (session 28's engine survivor
    `loaded or load_model(...)` -> `and`: the gates' model is the default one, so every token check passed)."""
    from engine.engine import Engine
    init = Engine.__init__
    mp.setattr(Engine, "__init__", lambda self, config=None, model=None, *, loaded=None, **kw:
               init(self, config, model, **kw) if config is not None else init(self, model=model, **kw))


def auto_id_off_by_one(mp: pytest.MonkeyPatch) -> None:
    """Automatic ids counted from -1: the first is "req--1" (session 29's engine survivor `_auto_id = -1`)."""
    from engine.engine import Engine
    init = Engine.__init__

    def planted(self, *args, **kw):
        init(self, *args, **kw)
        self._auto_id = -1
    mp.setattr(Engine, "__init__", planted)


def served_undo_fails(mp: pytest.MonkeyPatch) -> None:
    """A step interrupted once the step after it is launched ahead fails the engine also with poison off, as served
    (session 29's engine survivor `cfg.poison or step is not None`: the redo gate interrupted only before a launch
    ahead, in poison mode)."""
    from engine.engine import Engine
    undo = Engine._undo

    def planted(self, cause=None):
        self._poisoned_ahead = self._poisoned_ahead or self._ahead is not None
        undo(self, cause)
    mp.setattr(Engine, "_undo", planted)


def run_reads_arrivals(mp: pytest.MonkeyPatch) -> None:
    """A closed-loop run() delivers each request at its spec's arrival time, as an open loop does."""
    from engine.engine import Engine
    run = Engine._run
    mp.setattr(Engine, "_run", lambda self, specs, open_loop, progress, until: run(self, specs, True, progress, until))


def until_ignored(mp: pytest.MonkeyPatch) -> None:
    """run(until=...) serves on to the end."""
    from engine.engine import Engine
    run = Engine._run
    mp.setattr(Engine, "_run", lambda self, specs, open_loop, progress, until: run(self, specs, open_loop, progress,
                                                                                   None))


def dead_engine_serves(mp: pytest.MonkeyPatch) -> None:
    """A failed engine (a step lost half-way) is not marked dead: later calls go on over its broken state."""
    from engine.engine import Engine
    mp.setattr(Engine, "alive", lambda self: None)


def undone_twice(mp: pytest.MonkeyPatch) -> None:
    """An interrupted step counted twice as undone (as the campaign's `steps_undone += 2`): the census check allows
    extra forwards by that count, so it only loosens it."""
    from engine.engine import Engine
    undo = Engine._undo

    def planted(self, *args, **kwargs):
        undo(self, *args, **kwargs)
        self.steps_undone += 1
    mp.setattr(Engine, "_undo", planted)


def ahead_after_cancel(mp: pytest.MonkeyPatch) -> None:
    """A step launched ahead is taken when the real schedule differs from it only by rows cancelled since it was
    launched (matches() leaves them out): that launch computed their rows too, so every row after a cancelled one
    takes its neighbour's sample."""
    from engine import foresight
    from engine.engine import Engine
    from engine.request import State
    from engine.scheduler import Foresight

    def matches(step, plan) -> bool:
        rows = [a for a in step.rows if a.request.state is not State.CANCELLED]
        return foresight.matches(Foresight(step.chunks, rows), plan)
    mp.setattr(Engine, "matches", staticmethod(matches))


def slow_step(mp: pytest.MonkeyPatch) -> None:
    from gates.step_states import PLANT_ENV
    mp.setenv(PLANT_ENV, "200")


def cuda_without_flash(mp: pytest.MonkeyPatch) -> None:
    """A GPU machine, as the gate options see it, whose flash-attn does not import: the run is given --device cuda
    and must stop with the reason instead of skipping the flash configuration."""
    import kernels
    from gates import options
    real = kernels.why_unavailable

    def why(name, device, page_size=None):
        if name == "flash":
            return "flash-attn does not import: No module named 'flash_attn' (simulated)"
        return None if str(device).startswith("cuda") else real(name, device, page_size)
    mp.setattr(options, "cuda_devices", lambda: 1)
    mp.setattr(kernels, "why_unavailable", why)


def rewrite_a_golden(mp: pytest.MonkeyPatch) -> Callable[[], None]:
    """A gate run that rewrites a golden byte-identically, through the golden store's own atomic writer. Returns
    what puts the files' modes back (after the session's own checks), so the checkout is left as it was found."""
    from gates.golden import _atomic_write, golden_path
    base = golden_path(None, "small", "mixed-cpu", "hf", "cpu", "float32")
    modes = {}
    for path in (base.with_suffix(".meta.json"), base.with_suffix(".json.gz")):
        modes[path] = path.stat().st_mode & 0o777
        _atomic_write(path, path.read_bytes())
    return lambda: [os.chmod(path, mode) for path, mode in modes.items()]


STORAGE = "{tmp}/benchmarks"                         # the plant table fills in {tmp}


# What a failure message must say to name the cause (regexes). A token failure: where the token was computed (step,
# step kind, a decode row or a prompt chunk, page and slot, backend), then the triage's verdict. A poisoned read: the
# step, the reader, the slot read, its page and its owner, and (the gates' note) the backend it ran under.
def token_cause(source: str, verdict: str) -> str:
    return (r"computed at step \d+, an? [\w-]+ step[^\n]*from " + source + r"[^\n]*page \d+, slot \d+[^\n]*"
            r"backend \w+[\s\S]*verdict: " + verdict)


def poison_cause(owner: str) -> str:
    """`owner`: a regex for the slot's owner, given the reader as group 1."""
    return (r"step \d+ \([\w-]+\): non-finite logits[^\n]*\n[\s\S]*?(?<=\s)(\S+) read slot \d+ \(page \d+\): "
            r"owned by " + owner + r" \(position \d+\)(?=[\s\S]*in \S+ on \S+: backend \w+)")


def in_decode_rows(cause: str) -> str:
    """The verdict of a decode-row bug that triage's probe names (gates/triage.py: diagnose)."""
    return r"always: " + re.escape(cause) + r" \([^\n]*logit error [^\n]*\(in decode rows only"


@dataclass(frozen=True)
class Plant:
    what: str
    cause: str                          # regex: the failure message names the cause when it matches
    patch: Callable | None = None       # patch(mp); may return a callable run when the session is over
    args: tuple[str, ...] = ()          # pytest arguments the plant table adds (a plant of the command line)
    paths: tuple[str, ...] = ()         # what the plant table runs (default: gates/)
    baseline: tuple[str, ...] = ()      # an unplanted run the plant table makes first (pytest arguments)
    number_changing: bool = False       # must fail the CPU run within 20 s
    during_first_test: bool = False     # patched once the first test has run, not at configure
    device: str = "cpu"                 # "cuda": a plant of a GPU path, run by the plant table only on a GPU


PLANTS = {
    "rotary": Plant("a decode row's rotary position +1", token_cause("a decode row", in_decode_rows("a decode row's rotary position")), rotary,
                    number_changing=True),
    "cache-len": Plant("a decode row's cache length one short",
                       token_cause("a decode row", in_decode_rows("a decode row's cache length")),
                       cache_len, number_changing=True),
    "token-choice": Plant("every decode row takes its runner-up",
                          token_cause("a decode row", in_decode_rows("token choice")),
                          token_choice, number_changing=True),
    "chunk-position": Plant("every prompt chunk but a prompt's first one position late",
                            token_cause("its last prompt chunk", "only when its prompt is chunked"), chunk_position,
                            number_changing=True),
    "ahead-tokens": Plant("a pure decode step launched ahead takes each row's token from the next row's sample",
                          r"steps launched ahead[\s\S]*not a near tie under 0\.02", ahead_tokens,
                          number_changing=True),
    "append-value": Plant("the Triton decode's fused append attends to each row's own value 1% too large (CUDA)",
                          r"flash\.decode\.triton\+append.*wrong values", append_value,
                          args=("--device", "cuda", "--model", "small-trained"), device="cuda"),
    "mlp-up-row": Plant("the fused MLP kernel's up half reads one weight row late (CUDA)",
                        r"the fused MLP kernel \(kernels/mlp\.py\) at \d+ rows.*wrong values", mlp_up_row,
                        args=("--device", "cuda", "--model", "small-trained"), paths=("gates/test_mlp.py",),
                        device="cuda"),
    "mlp-never-fused": Plant("every MLP takes torch's kernels where the fused one is configured (CUDA)",
                             r"dispatch: mlp_kernel='triton' is configured \(the fused kernel up to 32 rows\), but "
                             r"MLPs of \d+ rows took torch", mlp_never_fused,
                             args=("--device", "cuda", "--model", "small-trained"), paths=("gates/test_smoke.py",),
                             device="cuda"),
    "pdl-no-wait": Plant("the Triton decode's kernels launched with PDL never wait for the kernel before them (CUDA)",
                         r"PDL vs without|'pdl': True", pdl_no_wait,
                         args=("--device", "cuda", "--model", "small-trained"), paths=("gates/test_graphs.py",),
                         device="cuda"),
    "linear-bias-late": Plant("the split-K linear kernel adds each column the next column's bias (CUDA)",
                              r"the split-K linear kernel \(kernels/linear\.py\) \(q/k/v\) at .*wrong values",
                              linear_bias_late, args=("--device", "cuda", "--model", "small-trained"),
                              paths=("gates/test_linear.py",), device="cuda"),
    "registry-gap": Plant("the kernel registry leaves out the torch decode kernel (no kernel gate case checks it)",
                          r"torch\.decode\.gather: taken in \d+ steps by the gates' engines, never checked by the "
                          r"kernel gate", registry_gap, args=("-k", "torch"),
                          paths=("gates/test_smoke.py::test_smoke", "gates/test_kernels.py")),
    "decode-via-prefill": Plant("the torch backend's decode calls routed through its prefill call (same kernel, same "
                                "values)", r"dispatch: torch\.decode\.gather is configured .* but no call dispatched "
                                r"to it", decode_via_prefill),
    "no-static-steps": Plant("the torch backend's static_steps lost (no step launched ahead on a CPU)",
                             r"no longer runs the captured steps' path on a CPU", no_static_steps,
                             paths=("gates/test_smoke.py",)),
    "prefix-default-off": Plant("the prefix cache switched off where the configuration's defaults are decided",
                                r"serves other than its record:\s+(E\s+)?configuration: recorded "
                                r"\S+/prefix/\S+, serves \S+/noprefix/", prefix_default_off),
    "schedule-log-kept": Plant("an engine built without a schedule log keeps one whole (memory grows by every step)",
                               r"an engine built without a schedule log kept one", schedule_log_kept),
    "chunk-default-513": Plant("the fused engine's default chunk budget 513 (every gate sets its own)",
                               r"the engines' defaults moved:\s+(E\s+)?fused: chunk_tokens 512 -> 513",
                               chunk_default_513),
    "stale-read": Plant("decode row i reads row i-1's block-table row (another request's pages)",
                        poison_cause(r"(?!\1 )\S+") + "|" + token_cause("a decode row", "only when batched with"),
                        stale_read, number_changing=True),
    "read-past-length": Plant("the torch kernels read one slot past each length, masked afterwards",
                              poison_cause(r"\1"), read_past_length),
    "fcfs": Plant("admission lets a later request that fits jump the blocked head",
                  r"strict FCFS admission violated: step \d+ admitted \S+ \(arrival \d+[^)]*\) while \S+ "
                  r"\(arrival \d+", fcfs),
    "eager-free": Plant("release() puts pages straight back on the free list, mid-step",
                        r"eviction at the end of the step violated: step \d+ released \S+'s pages \[[\d, ]+\] "
                        r"straight to the free list during the step", eager_free),
    "undo-drops-a-row": Plant("undoing an interrupted step that admitted also drops the last running request",
                              r"with interrupted steps on \S+: (the engine's schedule broke|interrupted at|no end)",
                              undo_drops_a_row, paths=("gates/test_redo.py",)),
    "vocab-check-lost": Plant("submit() accepts a prompt token past the vocabulary",
                              r"refused calls between steps: \d+ problems:\s+(E\s+)?submit with a token past the "
                              r"vocabulary between steps: accepted, expected TokenOutOfVocabError", vocab_check_lost,
                              paths=("gates/test_requests.py",)),
    "fits-check-lost": Plant("submit() no longer refuses a request larger than the whole pool",
                             r"submit with a request larger than the whole pool after the last step: accepted, "
                             r"expected NeverFitsError", fits_check_lost, paths=("gates/test_requests.py",)),
    "refused-id-kept": Plant("a request refused at submit keeps its id in the engine",
                             r"submit with an empty prompt between steps: refused, but the engine changed: requests",
                             refused_id_kept, paths=("gates/test_requests.py",)),
    "pop-keeps-topk": Plant("pop_result() keeps the popped request's top-k records",
                            r"after every pop the engine still holds results \[\] and top-k records \['",
                            pop_keeps_topk, paths=("gates/test_requests.py",)),
    "ahead-unpoisoned": Plant("the pages a step frees are poisoned after the step launched ahead of its end, not "
                              "before",
                              r"pages \[[\d, ]+\], which its end frees, were not poisoned before the step launched "
                              r"after it", ahead_unpoisoned, paths=("gates/test_requests.py",)),
    "trace-one-short": Plant("an engine with trace_limit keeps one step fewer than asked",
                             r"trace_limit=4 after \d+ steps kept the steps \[[\d, ]+\], not the last 4",
                             trace_one_short, paths=("gates/test_smoke.py",)),
    "blocked-when-full": Plant("a step records admission_blocked while every row is held",
                               r"admission blocked violated: step \d+ records admission_blocked=True, but \S+ waited "
                               r"with (\d+) of \1 rows held", blocked_when_full),
    "debt-time-doubled": Plant("each step's end gives the prefill-share debt twice the step's duration",
                               r"the debt's step times violated: step \d+ lasted [\d.]+ s on the engine's clock, but "
                               r"its end gave the prefill-share debt [\d.]+ s", debt_time_doubled),
    "score-max-refused": Plant("score() refuses a sequence of exactly the max positions",
                               r"score of exactly the max positions \(\d+ positions\): refused with "
                               r"ExceedsMaxPositionsError", score_max_refused, paths=("gates/test_requests.py",)),
    "score-pool-budget": Plant("score()'s pool check counts one position more than the sequence",
                               r"score of (exactly the whole pool \(\d+ positions\): refused with NeverFitsError|a "
                               r"sequence larger than the whole pool after the last step: NeverFitsError says "
                               r"'score: needs \d+ pages of \d+ slots \(prompt \d+ \+ budget 1\))",
                               score_pool_budget, paths=("gates/test_requests.py",)),
    "tp-workers-by-name": Plant("at tp > 1 the worker ranks load the default model by name, not the one given",
                                r"at tp 2 has its worker ranks load 'small' themselves", tp_workers_by_name,
                                paths=("gates/test_tp.py",)),
    "recover-skips-poison": Plant("the next step leaves unpoisoned the pages an interrupted poisoning left",
                                  r"which step \d+ freed \(its poisoning interrupted after its commit\), are not NaN "
                                  r"when step \d+ is scheduled", recover_skips_poison, paths=("gates/test_redo.py",)),
    "refused-tp-keeps-workers": Plant("a tp engine refused after its workers started leaves them running",
                                      r"at tp 2 refused overlap=True \(.*\), but its worker ranks still run: "
                                      r"stepgate-tp-rank1", refused_tp_keeps_workers, paths=("gates/test_tp.py",)),
    "loaded-anew": Plant("an engine given a loaded model loads the default one itself",
                         r"serves another model object, loaded anew", loaded_anew,
                         paths=("gates/test_requests.py",)),
    "auto-id-off-by-one": Plant("automatic request ids counted from -1",
                                r"the engine's first automatic id is 'req--1', not 'req-0'",
                                auto_id_off_by_one, paths=("gates/test_requests.py",)),
    "served-undo-fails": Plant("an engine with poison off fails instead of redoing a step interrupted after the "
                               "step after it was launched ahead",
                               r"EngineDeadError: the engine failed at step \d+ after poisoning the pages it frees",
                               served_undo_fails, paths=("gates/test_redo.py",)),
    "run-reads-arrivals": Plant("a closed-loop run delivers requests at their specs' arrival times",
                                r"arrived at [\d.]+ s on the engine's clock, after the first step started",
                                run_reads_arrivals, paths=("gates/test_requests.py",)),
    "until-ignored": Plant("run(until=...) serves on to the end",
                           r"run\(until=\.\.\.\) returned after \d+ steps with work left: False", until_ignored,
                           paths=("gates/test_requests.py",)),
    "dead-engine-serves": Plant("a failed engine is not marked dead",
                                r"after the PoisonedLogitsError the engine is not failed: step\(\) raised",
                                dead_engine_serves, paths=("gates/test_page_safety.py",)),
    "undone-twice": Plant("an interrupted step counted twice as undone",
                          r"steps interrupted before their commit, the engine counts \d+ undone", undone_twice,
                              paths=("gates/test_redo.py",)),
    "ahead-after-cancel": Plant("a step launched ahead is taken although a row of it was cancelled since",
                                r"with steps launched ahead on \S+, refused requests and \d+ cancels[\s\S]*"
                                r"tokens differ between without the traffic and with it", ahead_after_cancel,
                                paths=("gates/test_requests.py",)),
    "golden-write": Plant("a gate run rewrites a golden byte-identically",
                          r"run changed the goldens[\s\S]{0,600}(replaced by a new file|rewritten|mode 0)",
                          rewrite_a_golden, during_first_test=True),
    "missing-backend": Plant("a GPU machine (simulated) whose flash-attn does not import; the run is given --device "
                             "cuda", r"flash: flash-attn does not import", cuda_without_flash,
                             args=("--device", "cuda")),
    "typo": Plant("nothing planted: the run is given --engine fussed",
                  r"(?i)(unknown|invalid|not a known).{0,60}fussed|fussed.{0,80}(known|one of|choose)",
                  args=("--engine", "fussed")),
    "slow-step": Plant("a 200 ms sleep inside every timed step (STEPGATE_PLANT_SLOWDOWN_MS), against a baseline "
                       "of the step benchmarks recorded unplanted first", r"(?i)performance has regressed", slow_step,
                       args=(f"--benchmark-storage=file://{STORAGE}", "--benchmark-compare",
                             "--benchmark-compare-fail=median:10%"),
                       paths=("gates/test_step_timings.py",),
                       baseline=("gates/test_step_timings.py", f"--benchmark-storage=file://{STORAGE}",
                                 "--benchmark-autosave")),
}


# -- the plugin -----------------------------------------------------------------------------------------------------
def pytest_addoption(parser):
    g = parser.getgroup("plants", "planted bugs (tests/plants.py)")
    g.addoption("--plant", default=None, help=f"plant one bug for the whole session: {', '.join(PLANTS)}")
    g.addoption("--plant-record", default=None, help="write the first failing report here (JSON)")


class PlantPlugin:
    def __init__(self, config, plant: Plant | None):
        self.config, self.plant = config, plant
        self.mp = pytest.MonkeyPatch()
        self.undo: list[Callable[[], None]] = []
        self.record = config.getoption("--plant-record")
        self.recorded = False
        if plant is not None and plant.patch is not None and not plant.during_first_test:
            self.apply()

    def apply(self):
        done = self.plant.patch(self.mp)
        if callable(done):
            self.undo.append(done)

    def pytest_runtest_teardown(self, item):
        if self.plant is not None and self.plant.during_first_test and self.plant.patch is not None:
            self.apply()
            self.plant = None

    def write(self, nodeid: str, when: str, message: str):
        if self.record and not self.recorded:
            self.recorded = True
            with open(self.record, "w") as f:
                json.dump({"nodeid": nodeid, "when": when, "time": time.time(), "cpu_s": time.process_time(),
                           "message": message}, f)

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.write(report.nodeid, report.when, report.longreprtext)

    def pytest_collectreport(self, report):
        if report.failed:
            self.write(report.nodeid or "(collection)", "collect", report.longreprtext)

    def close(self):
        self.mp.undo()
        for f in self.undo:
            f()


@pytest.hookimpl(tryfirst=True)      # before gates/options.py reads the options: a plant may change what they see
def pytest_configure(config):
    name = config.getoption("--plant")
    if name is not None and name not in PLANTS:
        raise pytest.UsageError(f"--plant {name!r}: unknown plant; known: {', '.join(PLANTS)}")
    if name is None and not config.getoption("--plant-record"):
        return
    plugin = PlantPlugin(config, PLANTS.get(name))
    config.pluginmanager.register(plugin, "stepgate-plant")
    config.add_cleanup(plugin.close)
