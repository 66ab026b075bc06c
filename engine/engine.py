"""The engine: submit requests, step, run to completion, read results and the per-step trace."""
from __future__ import annotations

import gc
import operator
import time
import warnings
from dataclasses import dataclass

import torch

from . import errors
from .config import EngineConfig
from .loader import load_model
from .pool import PagePool
from .request import Request, RequestResult
from .runner import ModelRunner
from .scheduler import CancelResult, Chunk, Scheduler
from .tp_layers import rank_shape
from .workload import RequestSpec

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def torch_dtype(name) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def build_runner(model, config: EngineConfig, dtype, num_pages: int, max_kv: int, table_width: int,
                 runner_cls=ModelRunner, **runner_kw) -> ModelRunner:
    """A runner ready to serve: fused elementwise pieces, the runner over `num_pages` pages, the backend's warm-up
    and the captured decode steps. Every tensor-parallel rank builds its own this way (`model`: its shard)."""
    s = model.shape
    on_cuda = torch.device(config.device).type == "cuda"
    if config.compile_elementwise or (config.compile_elementwise is None and on_cuda):
        from .model import try_compile_elementwise
        why = try_compile_elementwise(config.device, dtype, s.hidden_size, s.num_heads + s.num_kv_heads, s.head_dim)
        if why:
            warnings.warn(f"torch.compile of the elementwise pieces failed; running them eagerly ({why})")
    graphs = Engine.use_cuda_graphs(config)
    runner = runner_cls(model, num_pages, config.page_size, config.backend, config.device, dtype,
                        poison=config.poison, record_topk=config.record_topk, pad_page=graphs, **runner_kw)
    warm = config.compile_warmup if config.compile_warmup is not None else runner.device.type == "cuda"
    if warm and hasattr(runner.backend, "warmup"):
        # compile every shape a step can reach now, so that no measured step includes a compile
        runner.backend.warmup(s.num_heads, s.num_kv_heads, s.head_dim, dtype, config.device, max_kv=max_kv,
                              max_prefill_tokens=config.chunk_tokens, max_rows=config.max_batch,
                              page_size=config.page_size)
    if graphs:   # after the backend's warm-up: a capture must not include a compile
        runner.capture_decode_graphs(config.max_batch, table_width, progress=config.progress,
                                     capture=config.capture_graphs)
        if config.forward == "fused" and config.tp == 1 and getattr(runner.backend, "graph_safe_prefill", False):
            # a step's prompt positions are at most chunk_tokens, beside at most max_batch decode tokens
            runner.capture_step_graphs(config.chunk_tokens + config.max_batch, config.max_batch, table_width,
                                       progress=config.progress, capture=config.capture_graphs)
    return runner


@dataclass
class StepRecord:
    """One line of the per-step trace."""
    index: int
    kind: str                 # pure-decode / loaded / chunk-only / idle
    prompt_positions: int
    decode_tokens: int
    chunks: int
    admitted: int
    start: float              # seconds since the engine's clock started
    duration: float           # seconds (device synchronised around the step when sync_trace is on)
    admission_blocked: bool = False   # the queue's head waited for pages while a row was free
    withheld: int = 0         # long prompts whose next prompt chunk waited for the decoders (prefill share)


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig(), model=None, *, loaded=None):
        """`model`: a checkpoint directory, an in-memory transformers model, "qwen2.5-1.5b-random", or None for the
        small model. `loaded`: an already loaded (model, hf_config, name), to share weights between engines."""
        self.config = config
        dtype = torch_dtype(config.dtype)
        self.model, self.hf_config, self.model_name = loaded or load_model(model, dtype, config.device)
        self.shape = self.model.shape
        num_pages = config.num_pages
        if num_pages is None:
            budget = config.kv_cache_bytes or ((16 << 30) if torch.device(config.device).type == "cuda"
                                               else (256 << 20))
            per_row = -(-min(config.max_model_len or self.shape.max_positions, self.shape.max_positions)
                        // config.page_size)
            # no more than max_batch rows of the longest request can ever use, plus the null page
            # tp > 1: each rank holds its own key/value heads of every page, so the budget is per rank (per GPU)
            num_pages = max(2, min(budget // ModelRunner.bytes_per_page(rank_shape(self.shape, config.tp),
                                                                        config.page_size, dtype),
                                   config.max_batch * per_row + 1))
        self.pool = PagePool(num_pages, config.page_size, prefix_cache=config.prefix_cache)
        self.scheduler = Scheduler.from_config(self.pool, config)
        self.max_model_len = min(config.max_model_len or self.shape.max_positions, self.shape.max_positions)
        if torch.device(config.device).type == "cuda":
            # an engine dropped earlier may still hold its KV cache in a reference cycle until the collector runs:
            # free it before this one takes its own (the benchmarks build engine after engine in one process)
            gc.collect()
        max_kv = min(self.max_model_len, self.pool.capacity * config.page_size)
        width = self.pool.pages_needed(self.max_model_len)
        if config.tp == 1:
            self.runner = build_runner(self.model, config, dtype, num_pages, max_kv, width)
        else:
            from .parallel import TPRunner
            # workers load a named model themselves; an in-memory one reaches them as shards from rank 0
            self.runner = TPRunner.start(config, self.model, dtype, num_pages, max_kv, width,
                                         source=(model or "small") if loaded is None else None)
        self.requests: dict[str, Request] = {}
        self.topk: dict[str, list[tuple[list[int], list[float]]]] = {}   # record mode: per emitted token
        self.trace: list[StepRecord] = []
        self.t0 = time.perf_counter()
        self._auto_id = 0

    @staticmethod
    def use_cuda_graphs(config: EngineConfig) -> bool:
        """cuda_graphs None: on where they can run (CUDA, a backend whose decode is graph-safe); True: required."""
        from kernels import backend_class
        reason = None
        if torch.device(config.device).type != "cuda":
            reason = "CUDA graphs need a CUDA device"
        elif not backend_class(config.backend).graph_safe_decode:
            reason = (f"the {config.backend!r} backend's decode is not graph-safe (its per-step tensors change "
                      f"shape); the 'flash' backend's is")
        if config.cuda_graphs and reason:
            raise ValueError(f"cuda_graphs=True but {reason}")
        return reason is None and config.cuda_graphs is not False

    # -- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the worker ranks (tp > 1; also at exit, or when the engine is collected). Results and the trace
        stay readable. Nothing to stop at tp 1."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- clock -----------------------------------------------------------------------------------------------
    def now(self) -> float:
        return time.perf_counter() - self.t0

    def reset_clock(self) -> None:
        self.t0 = time.perf_counter()

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)

    # -- requests --------------------------------------------------------------------------------------------
    def submit(self, prompt, budget, request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Queue a request. Bad input raises a RequestError subclass and changes nothing."""
        if request_id is None:
            while f"req-{self._auto_id}" in self.requests:
                self._auto_id += 1
            request_id = f"req-{self._auto_id}"
        request_id = str(request_id)
        budget = self.validate(prompt, budget, request_id)
        r = Request(request_id, [int(t) for t in prompt], budget,
                    self.now() if arrival_time is None else float(arrival_time))
        self.requests[r.request_id] = r
        self.scheduler.add(r)
        return r.request_id

    def validate(self, prompt, budget, request_id) -> None:
        if request_id in self.requests:
            raise errors.DuplicateRequestIdError(f"request id {request_id!r} is already in use")
        try:
            prompt = list(prompt)
        except TypeError:
            raise errors.RequestError(f"{request_id}: prompt must be a sequence of token ids") from None
        if not prompt:
            raise errors.EmptyPromptError(f"{request_id}: empty prompt")
        vocab = self.shape.vocab_size
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) and not (hasattr(t, "__index__")):
                raise errors.TokenOutOfVocabError(f"{request_id}: prompt[{i}] = {t!r} is not a token id")
            if not 0 <= int(t) < vocab:
                raise errors.TokenOutOfVocabError(
                    f"{request_id}: prompt[{i}] = {int(t)} is outside the vocabulary [0, {vocab})")
        try:
            n = operator.index(budget) if not isinstance(budget, bool) else None
        except TypeError:
            n = None
        if n is None or n < 1:
            raise errors.BadBudgetError(f"{request_id}: generation budget must be an integer >= 1, got {budget!r}")
        budget = n
        if len(prompt) + budget > self.max_model_len:
            raise errors.ExceedsMaxPositionsError(
                f"{request_id}: prompt ({len(prompt)}) + budget ({budget}) = {len(prompt) + budget} exceeds the "
                f"max positions served ({self.max_model_len}; the model's: {self.shape.max_positions})")
        need = self.pool.pages_needed(len(prompt) + budget)
        if need > self.pool.capacity:
            raise errors.NeverFitsError(
                f"{request_id}: needs {need} pages of {self.pool.page_size} slots (prompt {len(prompt)} + budget "
                f"{budget}) but the whole pool holds {self.pool.capacity}: it could never be admitted")
        return budget

    def cancel(self, request_id: str) -> CancelResult:
        """Stop a request between steps (between its prompt chunks or decode tokens). It keeps what it emitted; its
        pages return at the end of the next step; nobody else's tokens change. An unknown, finished or already
        cancelled id is a no-op: CancelResult.outcome says which ("unknown", "already-finished",
        "already-cancelled"), .noop is True."""
        res = self.scheduler.cancel(str(request_id), self.requests)
        if res.cancelled:
            self.requests[str(request_id)].finish_time = self.now()
        return res

    # -- the step --------------------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        cfg = self.config
        if cfg.sync_trace:
            self._sync()
        start = self.now()
        plan = self.scheduler.schedule()
        # cached pages evicted to admit this step's requests: NaN before their new owners write them
        self.runner.poison_pages(self.pool.take_evicted())
        for r in plan.admitted:
            r.admit_time = start
        blocked = bool(self.scheduler.waiting) and len(self.scheduler.running) < cfg.max_batch
        pages_of = self.pool.owned
        out = self.runner.run(plan, pages_of, cfg.forward) if not plan.empty else None
        if cfg.sync_trace:
            self._sync()
        end = self.now()
        if out is not None:
            sampled = plan.sampled
            if cfg.poison and any(out.nonfinite):
                err = self.poison_error(plan, sampled, out.nonfinite)   # reads the cache as the step left it
                self.scheduler.finish_step()   # keep the pool consistent before raising
                raise err
            plan.apply(out.tokens, end)
            for r, ids, vals in zip(sampled, out.topk_ids, out.topk_vals):
                self.topk.setdefault(r.request_id, []).append((ids, vals))
        freed = self.scheduler.finish_step(duration=end - start)   # the step's time feeds the prefill-share debt
        self.runner.poison_pages(freed)
        rec = StepRecord(plan.index, plan.kind, plan.prompt_positions, len(plan.decodes), len(plan.chunks),
                         len(plan.admitted), start, end - start, blocked, plan.withheld)
        self.trace.append(rec)
        return rec

    def poison_error(self, plan, sampled, nonfinite) -> errors.PoisonedLogitsError:
        """Names the reader, the slot it read (found by re-running the step: ModelRunner.poisoned_reads), that
        slot's page and whose it is or was, then every request in the step with its pages."""
        bad = [r.request_id for r, nf in zip(sampled, nonfinite) if nf]
        row = list(nonfinite).index(True)
        reader = sampled[row].request_id
        found = self.runner.poisoned_reads(plan, self.pool.owned, self.config.forward, row)
        lines = [f"step {plan.index} ({plan.kind}): non-finite logits for {bad}: a kernel read a freed or "
                 f"never-written KV slot."]
        if found is None:
            lines.append(f"  {reader}: its logits stay non-finite with every NaN slot made finite: the NaN comes "
                         f"from the step's own computation, not from a slot it read")
        slots, more = found or ([], False)
        whose = []
        for slot in slots:
            page = slot // self.pool.page_size
            whose.append(self.slot_holder(plan, page, slot))
            lines.append(f"  {reader} read slot {slot} (page {page}): {whose[-1]}")
        if more:
            lines.append(f"  {reader} also read NaN in other pages (not searched: each costs about "
                         f"log2(pages) + log2(page_size) forwards)")
        lines.append("Requests in this step and the pages they own:")
        for c in plan.chunks:
            lines.append(f"  {c.request.request_id}: prompt chunk [{c.start}, {c.start + c.length}) of "
                         f"{c.request.prompt_len}, pages {self.pool.owned.get(c.request.request_id)}")
        for r in plan.decodes:
            lines.append(f"  {r.request_id}: decode token at position {r.num_cached}, "
                         f"pages {self.pool.owned.get(r.request_id)}")
        first = slots[0] if slots else None
        return errors.PoisonedLogitsError(
            plan.index, bad, "\n".join(lines), reader=reader, slot=first,
            page=None if first is None else first // self.pool.page_size,
            owner=whose[0] if whose else None, reads=slots)

    def slot_holder(self, plan, page: int, slot: int) -> str:
        """Whose `slot` is or was: owner and position, and whether it was written, freed or never handed out."""
        if page == self.runner.pad_page:
            return "the pad page of the captured decode steps: no request owns it"
        owner, state = self.pool.holder(page)
        if owner is None:
            return "a page never owned by any request: never written since the pool was made"
        r = self.requests.get(owner)
        pages = r.pages if r is not None and page in r.pages else self.pool.owned.get(owner, [])
        pos = pages.index(page) * self.pool.page_size + slot % self.pool.page_size if page in pages else None
        at = f"{owner} (position {pos})" if pos is not None else owner
        if state != "owned":
            step = self.pool.last_owner[page][1]
            return f"last owned by {at}, " + ("released in this step" if state == "released" else
                                              f"freed at the end of step {step}")
        if r is None or pos is None:
            return f"owned by {at}"
        # what this step writes for the owner counts as written: the forward writes before it reads
        wrote = {c.request.request_id: c.start + c.length for c in plan.chunks}
        wrote.update({d.request_id: d.num_cached + 1 for d in plan.decodes})
        cached = wrote.get(owner, r.num_cached)
        if pos >= cached:
            return f"owned by {at}, never written ({owner} has cached {cached} positions, this step's included)"
        return (f"owned by {at}, written with NaN at step {r.step_of(pos)} (layers past the first): that step's "
                f"forward read a poisoned slot itself")

    # -- running ---------------------------------------------------------------------------------------------
    def run(self, specs: list[RequestSpec] | None = None, open_loop: bool = False, progress=None) -> dict:
        """Serve `specs` (and whatever is queued) to completion. open_loop: deliver each request at its
        arrival_time on the engine's clock, while the engine works; otherwise all arrive now."""
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
            if not self.scheduler.has_work:
                time.sleep(max(0.0, min(pending[i].arrival_time - now, 0.01)))
                continue
            rec = self.step()
            if progress is not None:
                progress(rec)
        return self.results()

    def results(self) -> dict[str, RequestResult]:
        return {rid: RequestResult.of(r) for rid, r in self.requests.items()}

    # -- teacher forcing -------------------------------------------------------------------------------------
    def score(self, tokens: list[int], last_only: bool = False) -> torch.Tensor:
        """Logits [len(tokens), vocab] at every position of `tokens` ([1, vocab]: the last position's, with
        `last_only`), in one forward over the paged cache."""
        owner = f"__score__{len(tokens)}"
        self.pool.reserve(owner, len(tokens))
        self.runner.poison_pages(self.pool.take_evicted())
        try:
            r = Request(owner, list(tokens), 1)
            return self.runner.score(Chunk(r, 0, len(tokens)), self.pool.owned[owner], last_only)
        finally:
            self.pool.release(owner)
            if not self.pool.in_step:
                self.runner.poison_pages(self.pool.end_step())
