"""Fixed cache states for step timings: an engine's cache holding decoding rows and a half-cached prompt
(FixedState, one per model and (backend, page size) in States) and a synthetic paged cache for decode kernels
(KernelState). A timed step runs a plan over them again and again without changing anything.
"""
from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass

import torch

import kernels
from engine import Engine, lineage_config
from engine.config import LINEAGE, lineage_layers
from engine.loader import RANDOM_1P5B, load_model
from engine.pool import pages_for
from engine.request import Request, State
from engine.scheduler import WORK_KINDS, Chunk, StepKind, StepPlan
from engine.workload import MIXED, MIXED_CPU, SEED, UNIFORM_CPU, Workload

from .failure import GateFailure
from .options import gate_options

ROWS = 32                                   # decode rows of the fixed state (max batch)
KERNEL_BACKENDS = ("torch", "flex", "flash")
PLANT_ENV = "STEPGATE_PLANT_SLOWDOWN_MS"
ROUNDS_ENV = "STEPGATE_BENCH_ROUNDS"
BUILD_CHUNK = 1024                          # chunk_tokens while building the state (fewer steps; not timed)


# -- options -------------------------------------------------------------------------------------------------------
def run_device(config) -> str:
    return gate_options(config).device


def run_dtype(config) -> str:
    return gate_options(config).dtype


def is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class ModelCase:
    model: str             # "small", "qwen2.5-1.5b-random" or a checkpoint dir
    workload: Workload     # whose first ROWS prompts make the decode rows' histories

    @property
    def chunk(self) -> int:
        """Positions in the timed prompt chunk: the workload's chunk budget (512; CPU-scaled 128)."""
        return self.workload.chunk_tokens


def model_cases(config) -> list[ModelCase]:
    """The model under test with its class's workload; on CUDA the default small model also brings the 1.5B shape."""
    o = gate_options(config)
    if o.model_class == "small":
        extra = [ModelCase(RANDOM_1P5B, MIXED)] if o.model == "small" and o.is_cuda else []
        return [ModelCase(o.model, MIXED_CPU)] + extra
    return [ModelCase(o.model, MIXED if o.is_cuda else MIXED_CPU)]


def ratio_case_for(case: ModelCase, device) -> ModelCase:
    """The state the fused-vs-chunked gate runs on: the benchmarks' mixed state on GPU, the uniform control's short
    histories on CPU, where the saving of fusing stands above a shared CPU's noise (docs/performance.md)."""
    if is_cuda(device):
        return case
    return ModelCase(case.model, UNIFORM_CPU)


def model_label(model: str) -> str:
    return os.path.basename(str(model).rstrip("/")) or str(model)


def default_rounds(device) -> tuple[int, int]:
    """(rounds, warmup rounds) of each benchmark."""
    rounds, warmup = (30, 3) if is_cuda(device) else (5, 1)
    if os.environ.get(ROUNDS_ENV):
        rounds = max(1, int(os.environ[ROUNDS_ENV]))
        warmup = min(warmup, rounds)
    return rounds, warmup


def planted_slowdown() -> None:
    """A deliberate slowdown, only when the test environment asks for one (tests/test_planted_slowdown.py)."""
    ms = os.environ.get(PLANT_ENV)
    if ms and float(ms) > 0:
        time.sleep(float(ms) / 1000.0)


def backend_reason(backend: str, device, page_size: int | None) -> str | None:
    """Why an attention backend cannot run here (None if it can): kernels' own reason, or that it is not there."""
    if backend not in kernels.BACKENDS:
        return (f"attention backend {backend!r} is not registered in kernels.BACKENDS "
                f"(registered: {sorted(kernels.BACKENDS)})")
    return kernels.why_unavailable(backend, device, page_size)


def graph_capable(config_name: str, device) -> bool:
    """Whether an engine of this configuration captures its pure decode steps here (engine.use_cuda_graphs)."""
    return config_reason(config_name, device) is None and Engine.use_cuda_graphs(
        lineage_config(config_name, device=str(device)))


def config_reason(config_name: str, device) -> str | None:
    base = LINEAGE[config_name]
    reason = backend_reason(base["backend"], device, base["page_size"])
    return None if reason is None else f"engine configuration {config_name!r}: {reason}"


def captured(runner, kind: str):
    """The runner's graph set for steps of this kind (None: they run eagerly)."""
    return runner.graphs if kind == StepKind.PURE_DECODE else runner.step_graphs


def synchronizer(device):
    if is_cuda(device):
        dev = torch.device(device)
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


# -- the fixed state -----------------------------------------------------------------------------------------------
class FixedState:
    """An engine whose cache holds `rows` decoding requests (the workload's first prompts) and one request half way
    through a two-chunk prompt. Step plans over them can be run again and again without changing anything."""

    def __init__(self, case: ModelCase, config_name: str, backend: str, page_size: int, device: str, dtype: str,
                 loaded=None, rows: int = ROWS):
        """config_name: the lineage configuration whose engine it builds, over `backend` at `page_size` and with the
        fused forward (a timed step's forward is its call's): its layers (the references' plain PyTorch, flash's
        compiled pieces and Triton MLP: engine.config.REFERENCE_LAYERS)."""
        self.case, self.device, self.dtype, self.rows = case, device, dtype, rows
        self.backend, self.page_size = backend, page_size
        self.sync = synchronizer(device)
        vocab = (loaded[0].shape.vocab_size if loaded else None)
        self.specs = case.workload.requests(vocab)[:rows]
        if len(self.specs) < rows:
            raise ValueError(f"workload {case.workload.name} has {len(self.specs)} requests, {rows} rows asked")
        # generation budgets large enough that nobody finishes before the last row starts decoding
        total_prompt = sum(len(s.prompt) for s in self.specs)
        build_chunk = max(BUILD_CHUNK, case.chunk)     # a captured step must hold the timed chunk
        self.slack = -(-total_prompt // build_chunk) + rows + 2
        need = sum(pages_for(len(s.prompt) + s.budget + self.slack, page_size) for s in self.specs)
        need += pages_for(2 * case.chunk + 1, page_size)
        # max_batch rows + 1: the timed chunk's request holds a row too, so a captured loaded step holds all 33
        # the configuration's own layers over the fused forward (a step's forward mode is the timed call's)
        cfg = lineage_config(config_name, forward="fused", backend=backend, page_size=page_size, device=device,
                             dtype=dtype, max_batch=rows + 1, chunk_tokens=build_chunk, num_pages=need + 2)
        self.engine = Engine(cfg, case.model, loaded=loaded)
        self._decodes: list[Request] | None = None
        self._chunk: Chunk | None = None

    # the two halves are built on first use, so a benchmark of a chunk-only step needs no decode rows
    @property
    def decodes(self) -> list[Request]:
        if self._decodes is None:
            e = self.engine
            for s in self.specs:
                e.submit(s.prompt, s.budget + self.slack, s.request_id)
            while e.scheduler.waiting or any(r.state is not State.DECODE for r in e.scheduler.running):
                e.step()
            rows = [r for r in e.scheduler.running if r.state is State.DECODE]
            if len(rows) != self.rows:
                raise GateFailure(f"fixed state: {len(rows)} decoding rows, {self.rows} wanted")
            self._decodes = rows
        return self._decodes

    @property
    def chunk(self) -> Chunk:
        if self._chunk is None:
            e, n = self.engine, self.case.chunk
            h = self.chunk_history
            rng = random.Random(SEED + 1)
            hi = min(4000, e.shape.vocab_size)
            r = Request("__timed_chunk__", [rng.randrange(3, hi) for _ in range(h + n)], 1)
            e.pool.reserve(r.request_id, r.slots_needed)
            r.state = State.PREFILL
            if h:
                e.runner.run(StepPlan(-1, chunks=[Chunk(r, 0, h)]), e.pool.owned, "fused")   # the cached first chunk
            r.num_cached = h
            self._chunk = Chunk(r, h, n)      # the timed chunk: the prompt's end, after h cached positions
        return self._chunk

    @property
    def chunk_history(self) -> int:
        """Positions cached before the timed chunk: a chunk's worth, or what the model's positions leave (the
        request, its chunk and one sampled token must fit: a 16,384-position chunk of the 1.5B shape's 32,768)."""
        return max(0, min(self.case.chunk, self.engine.max_model_len - self.case.chunk - 1))

    def plan(self, kind: str) -> StepPlan:
        if kind == StepKind.PURE_DECODE:
            return StepPlan(0, decodes=list(self.decodes))
        if kind == StepKind.LOADED:
            return StepPlan(0, chunks=[self.chunk], decodes=list(self.decodes))
        if kind == StepKind.CHUNK_ONLY:
            return StepPlan(0, chunks=[self.chunk])
        raise ValueError(f"unknown step kind {kind!r}; known: {[str(k) for k in WORK_KINDS]}")

    def step_fn(self, kind: str, forward_mode: str, graphs: bool = True):
        """One step's forward(s) + sampling, device synchronised around it; nothing in the state changes. A step
        replays its CUDA graph where the engine captured its kind, unless graphs=False."""
        plan = self.plan(kind)
        runner, owned, sync = self.engine.runner, self.engine.pool.owned, self.sync

        def step():
            sync()
            planted_slowdown()
            out = runner.run(plan, owned, forward_mode, use_graphs=graphs)
            sync()
            return out
        return step

    def describe(self, kind: str) -> dict:
        plan = self.plan(kind)
        hist = [r.num_cached + 1 for r in plan.decodes]
        return dict(rows=len(plan.decodes), prompt_positions=plan.prompt_positions,
                    tokens=plan.prompt_positions + len(plan.decodes),
                    history_total=sum(hist), history_max=max(hist, default=0), workload=self.case.workload.name,
                    backend=self.backend, page_size=self.page_size, chunk_history=self.chunk_history)


class States:
    """Loaded weights (one copy per model) and fixed states (one per model and (backend, page size))."""

    def __init__(self, device: str, dtype: str):
        self.device, self.dtype = device, dtype
        self.weights: dict[str, tuple] = {}
        self.states: dict[tuple, FixedState] = {}

    def loaded(self, model: str):
        if model not in self.weights:
            from engine.dtypes import torch_dtype
            self.weights[model] = load_model(model, torch_dtype(self.dtype), self.device)
        return self.weights[model]

    def get(self, case: ModelCase, config_name: str, backend: str | None = None) -> FixedState:
        base = LINEAGE[config_name]
        backend = backend or base["backend"]
        # chunked and fused share backend, page size and layers: one state
        key = (case, backend, base["page_size"], tuple(sorted(lineage_layers(config_name).items())))
        if key not in self.states:
            self.states[key] = FixedState(case, config_name, backend, base["page_size"], self.device, self.dtype,
                                          self.loaded(case.model))
        return self.states[key]

    def close(self) -> None:
        self.states.clear()
        self.weights.clear()
        gc.collect()
        if is_cuda(self.device) and torch.cuda.is_available():
            torch.cuda.empty_cache()


# -- the decode kernel's state --------------------------------------------------------------------------------------
class KernelState:
    """One step's decode attention over a synthetic paged cache: `rows` requests with the given histories, every
    layer's own cache, pages handed out in order. Values are random: timing does not depend on them."""

    def __init__(self, backend: str, shape, histories: list[int], page_size: int, device, dtype,
                 layers: int | None = None, seed: int = 0):
        dev = torch.device(device)
        self.sync = synchronizer(device)
        self.layers = layers or shape.num_layers
        self.backend = kernels.get_backend(backend, dev, page_size)
        self.scale = shape.head_dim ** -0.5
        tables, nxt = [], 1                 # page 0 is the null page
        for h in histories:
            n = pages_for(h, page_size)
            tables.append(list(range(nxt, nxt + n)))
            nxt += n
        width = max(len(t) for t in tables)
        g = torch.Generator(device=dev).manual_seed(seed)
        rand = lambda *size: torch.randn(*size, generator=g, device=dev, dtype=dtype)  # noqa: E731
        self.caches = []
        for _ in range(self.layers):
            k = rand(nxt, page_size, shape.num_kv_heads, shape.head_dim)
            v = rand(nxt, page_size, shape.num_kv_heads, shape.head_dim)
            k[0] = 0
            v[0] = 0
            self.caches.append((k, v))
        self.q = rand(len(histories), shape.num_heads, shape.head_dim)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev)
        self.args = (list(histories), bt, torch.tensor(histories, dtype=torch.int32, device=dev),
                     torch.arange(len(histories) + 1, dtype=torch.int32, device=dev), page_size)

    def batch(self):
        kv_lens, bt, kv_t, cu, ps = self.args
        return kernels.AttnBatch([1] * len(kv_lens), list(kv_lens), bt, kv_t, cu, ps)

    def step_fn(self):
        """prepare (once per step) + one decode call per layer, device synchronised around it."""
        backend, caches, q, scale, sync = self.backend, self.caches, self.q, self.scale, self.sync

        @torch.inference_mode()
        def step():
            sync()
            planted_slowdown()
            b = self.batch()
            backend.prepare(b, "decode")
            for k, v in caches:
                backend.decode(q, k, v, b, scale)
            sync()
        return step


def kernel_page_size(backend: str) -> int:
    cls = kernels.BACKENDS.get(backend)
    sizes = getattr(cls, "page_sizes", None)
    return max(64, min(sizes)) if sizes else 64


def model_shape(states: States, model: str):
    return states.loaded(model)[0].shape
