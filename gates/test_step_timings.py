"""Step timings: pytest-benchmark records of pure decode, loaded and chunk-only steps per engine configuration (and
of the decode kernel per attention backend), at FIXED cache states, plus ratio gates that must hold on any machine.

The fixed state (per model and per (backend, page size)): an engine serves the first 32 requests of the mixed draw
until all 32 rows are decoding (CPU: `MIXED_CPU`'s scaled histories on the small model; `--device cuda`: the small
model with `MIXED_CPU` and "qwen2.5-1.5b-random" with `MIXED`), and one more request whose prompt is two chunks long
has its first chunk cached (chunk: 512 positions, CPU-scaled 128). A timed step is the forward + sampling of a plan
built from those requests, `engine.runner.run(plan, engine.pool.owned, forward_mode)`, with the device synchronised
around it. Nothing is mutated: the step writes the same K/V into the same slots every time, and no request advances.

    pure decode:  32 decode tokens          loaded: the chunk + 32 decode tokens          chunk-only: the chunk

Baselines are stored per machine with pytest-benchmark's own storage (one folder per machine: pytest-benchmark's
folder is named by OS/Python only, so name the machine in the path):

    # record a baseline on this machine
    pytest gates/test_step_timings.py --benchmark-autosave --benchmark-storage=file://golden/benchmarks/<machine>
    # check against the newest baseline of this machine: a median 10% slower fails the run
    pytest gates/test_step_timings.py --benchmark-storage=file://golden/benchmarks/<machine> \
        --benchmark-autosave --benchmark-compare --benchmark-compare-fail=median:10%
    # what regressed by how much (newest two saved runs, or --baseline/--current JSON paths)
    python -m gates.alert --storage golden/benchmarks/<machine> --markdown bench-summary.md

On GPU add `--device cuda` (fp16 by default). CI on CPU only runs this file (its absolute times are never compared
across machines); what must hold on any machine are the ratio gates below, measured in one run on one state.

Environment (tests only): STEPGATE_PLANT_SLOWDOWN_MS adds a sleep inside every timed step (tests/ uses it to prove
that a slowdown is caught); STEPGATE_BENCH_ROUNDS overrides the rounds per benchmark.
"""
from __future__ import annotations

import gc
import os
import random
import statistics
import time
from dataclasses import dataclass

import pytest
import torch

import kernels
from engine import Engine, lineage_config
from engine.config import LINEAGE
from engine.loader import RANDOM_1P5B, load_model
from engine.pool import pages_for
from engine.request import Request, State
from engine.scheduler import Chunk, StepPlan
from engine.workload import MIXED, MIXED_CPU, SEED, UNIFORM_CPU, Workload

from .options import gate_options

# a timing taken beside another worker's steps is noise, and pytest-benchmark turns itself off under xdist
pytestmark = pytest.mark.serial

ROWS = 32                                   # decode rows of the fixed state (max batch)
KINDS = ("pure-decode", "loaded", "chunk-only")
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
        return int(getattr(self.workload, "chunk_tokens", None) or (128 if self.workload.name.endswith("-cpu")
                                                                    else 512))


def model_cases(config) -> list[ModelCase]:
    """The model under test with its class's workload; on CUDA the default small model also brings the 1.5B shape."""
    o = gate_options(config)
    if o.model_class == "small":
        extra = [ModelCase(RANDOM_1P5B, MIXED)] if o.model == "small" and o.is_cuda else []
        return [ModelCase(o.model, MIXED_CPU)] + extra
    return [ModelCase(o.model, MIXED if o.is_cuda else MIXED_CPU)]


def ratio_case_for(case: ModelCase, device) -> ModelCase:
    """The state the fused-vs-chunked gate runs on. GPU: the benchmarks' mixed state. CPU: the uniform control's
    histories (32 rows of 64 positions + the 128-position chunk): at the mixed state the small model's CPU step is
    bound by gathering long histories, which both modes do alike, so the forward that fusing saves is ~1-2% of the
    step, under the noise of a shared CPU (A/A repeats differ by 5-10%); with short histories the saving is ~20%."""
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
    return runner.graphs if kind == "pure-decode" else runner.step_graphs


def synchronizer(device):
    if is_cuda(device):
        dev = torch.device(device)
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


# -- the fixed state -----------------------------------------------------------------------------------------------
class FixedState:
    """An engine whose cache holds `rows` decoding requests (the workload's first prompts) and one request half way
    through a two-chunk prompt. Step plans over them can be run again and again without changing anything."""

    def __init__(self, case: ModelCase, backend: str, page_size: int, device: str, dtype: str, loaded=None,
                 rows: int = ROWS):
        self.case, self.device, self.dtype, self.rows = case, device, dtype, rows
        self.backend, self.page_size = backend, page_size
        self.sync = synchronizer(device)
        vocab = (loaded[0].shape.vocab_size if loaded else None)
        self.specs = case.workload.requests(vocab)[:rows]
        if len(self.specs) < rows:
            raise ValueError(f"workload {case.workload.name} has {len(self.specs)} requests, {rows} rows asked")
        # generation budgets large enough that nobody finishes before the last row starts decoding
        total_prompt = sum(len(s.prompt) for s in self.specs)
        self.slack = -(-total_prompt // BUILD_CHUNK) + rows + 2
        need = sum(pages_for(len(s.prompt) + s.budget + self.slack, page_size) for s in self.specs)
        need += pages_for(2 * case.chunk + 1, page_size)
        # max_batch rows + 1: the timed chunk's request holds a row too, so a captured loaded step holds all 33
        cfg = lineage_config("fused", backend=backend, page_size=page_size, device=device, dtype=dtype,
                             max_batch=rows + 1, chunk_tokens=BUILD_CHUNK, num_pages=need + 2)
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
            assert len(rows) == self.rows, f"fixed state: {len(rows)} decoding rows, {self.rows} wanted"
            self._decodes = rows
        return self._decodes

    @property
    def chunk(self) -> Chunk:
        if self._chunk is None:
            e, n = self.engine, self.case.chunk
            rng = random.Random(SEED + 1)
            hi = min(4000, e.shape.vocab_size)
            r = Request("__timed_chunk__", [rng.randrange(3, hi) for _ in range(2 * n)], 1)
            e.pool.reserve(r.request_id, r.slots_needed)
            r.state = State.PREFILL
            e.runner.run(StepPlan(-1, chunks=[Chunk(r, 0, n)]), e.pool.owned, "fused")   # the cached first chunk
            r.num_cached = n
            self._chunk = Chunk(r, n, n)      # the timed chunk: second half, completes the prompt
        return self._chunk

    def plan(self, kind: str) -> StepPlan:
        if kind == "pure-decode":
            return StepPlan(0, decodes=list(self.decodes))
        if kind == "loaded":
            return StepPlan(0, chunks=[self.chunk], decodes=list(self.decodes))
        if kind == "chunk-only":
            return StepPlan(0, chunks=[self.chunk])
        raise ValueError(f"unknown step kind {kind!r}; known: {KINDS}")

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
                    backend=self.backend, page_size=self.page_size, chunk_history=self.case.chunk)


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
        key = (case, backend, base["page_size"])
        if key not in self.states:
            self.states[key] = FixedState(case, backend, base["page_size"], self.device, self.dtype,
                                          self.loaded(case.model))
        return self.states[key]

    def close(self) -> None:
        self.states.clear()
        self.weights.clear()
        gc.collect()
        if is_cuda(self.device) and torch.cuda.is_available():
            torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def states(pytestconfig):
    s = States(run_device(pytestconfig), run_dtype(pytestconfig))
    yield s
    s.close()


# -- ratio gates: a function, so tests/ can plant a regression -----------------------------------------------------
@dataclass
class Ratio:
    fast_name: str
    slow_name: str
    fast_median: float      # seconds
    slow_median: float
    reps: int

    @property
    def ratio(self) -> float:
        return self.fast_median / self.slow_median if self.slow_median > 0 else float("inf")

    def __str__(self) -> str:
        return (f"{self.fast_name}: median {self.fast_median * 1e3:.3f} ms; {self.slow_name}: median "
                f"{self.slow_median * 1e3:.3f} ms; ratio {self.ratio:.3f} over {self.reps} interleaved repetitions")


def measure_pair(fast, slow, reps: int = 15, warmup: int = 2, sync=None) -> tuple[float, float]:
    """Medians (seconds) of two callables timed interleaved on the same state (ABBA order, so a drift in the
    machine's speed lands on both)."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fast()
        slow()
    tf, ts = [], []

    def timed(fn, into):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        into.append(time.perf_counter() - t)
    for i in range(reps):
        if i % 2 == 0:
            timed(fast, tf)
            timed(slow, ts)
        else:
            timed(slow, ts)
            timed(fast, tf)
    return statistics.median(tf), statistics.median(ts)


def check_faster(fast_name: str, fast, slow_name: str, slow, reps: int = 15, warmup: int = 2, sync=None,
                 max_ratio: float = 1.0) -> Ratio:
    """Assert that `fast` is cheaper than `slow` (median(fast) < max_ratio * median(slow)), measured interleaved in
    one run. Returns both medians; the failure message gives both."""
    f, s = measure_pair(fast, slow, reps, warmup, sync)
    r = Ratio(fast_name, slow_name, f, s, reps)
    assert f < max_ratio * s, (f"ratio gate: {fast_name} is not cheaper than {slow_name} "
                               f"(want ratio < {max_ratio:g}): {r}")
    return r


# -- parametrisation -----------------------------------------------------------------------------------------------
def pytest_generate_tests(metafunc):
    cfg = metafunc.config
    device = run_device(cfg)
    dev = torch.device(device).type
    cases = model_cases(cfg)
    if "step_case" in metafunc.fixturenames:
        params = [pytest.param((case, name, kind, True, None), id=f"{dev}-{model_label(case.model)}-{name}-{kind}")
                  for case in cases for name in LINEAGE for kind in KINDS]
        # the graph path's eager twin, timed in the same run (graphs are captured only where a config allows)
        params += [pytest.param((case, name, kind, False, None),
                                id=f"{dev}-{model_label(case.model)}-{name}-{kind}-eager")
                   for case in cases for name in LINEAGE if graph_capable(name, device) for kind in KINDS]
        # `fused` on the flex backend: the flash generation's predecessor kernel, beside it in the same run (GPU:
        # on CPU, flex compiles every shape with Inductor's C++ backend, too slow for this file)
        if dev == "cuda":
            params += [pytest.param((case, "fused", kind, True, "flex"),
                                    id=f"{dev}-{model_label(case.model)}-fused-flex-{kind}")
                       for case in cases for kind in KINDS]
        metafunc.parametrize("step_case", params)
    if "kernel_case" in metafunc.fixturenames:
        params = [pytest.param((case, b), id=f"{dev}-{model_label(case.model)}-{b}")
                  for case in cases for b in KERNEL_BACKENDS]
        metafunc.parametrize("kernel_case", params)
    if "ratio_case" in metafunc.fixturenames:
        metafunc.parametrize("ratio_case", [pytest.param(c, id=f"{dev}-{model_label(c.model)}") for c in cases])


# -- step benchmarks -----------------------------------------------------------------------------------------------
def test_step_time(benchmark, states, step_case):
    """Forward + sampling of one step at the fixed state, per engine configuration and step kind (steps replay CUDA
    graphs where the configuration captures their kind; the `-eager` twin times the same step without)."""
    case, config_name, kind, graphs, backend = step_case
    reason = config_reason(config_name, states.device) or (
        backend and backend_reason(backend, states.device, LINEAGE[config_name]["page_size"]))
    if reason:
        pytest.skip(reason)
    st = states.get(case, config_name, backend)
    forward = LINEAGE[config_name]["forward"]
    fn = st.step_fn(kind, forward, graphs=graphs)
    info = st.describe(kind)
    benchmark.group = f"step {torch.device(states.device).type}/{states.dtype} {model_label(case.model)} {kind}"
    benchmark.extra_info.update(model=model_label(case.model), engine=config_name, forward=forward, kind=kind,
                                device=states.device, dtype=states.dtype,
                                cuda_graphs=bool(graphs and captured(st.engine.runner, kind)), **info)
    rounds, warmup = default_rounds(states.device)
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup, iterations=1)
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats is not None and getattr(stats, "stats", None) is not None else None
    if median:
        benchmark.extra_info["tokens_per_s"] = info["tokens"] / median


# -- decode kernel benchmarks --------------------------------------------------------------------------------------
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


def test_decode_kernel_time(benchmark, states, kernel_case):
    """One step's decode attention (all layers) at 32 rows with the mixed draw's histories, per backend."""
    case, backend = kernel_case
    page = kernel_page_size(backend)
    reason = backend_reason(backend, states.device, page)
    if reason:
        pytest.skip(reason)
    if backend == "flex" and not is_cuda(states.device):
        pytest.skip("flex on CPU compiles every shape with Inductor's C++ backend (10-25 s cold each), too slow for "
                    "this file's CPU budget: flex kernel timings are recorded with --device cuda")
    from engine.dtypes import torch_dtype
    shape = model_shape(states, case.model)
    hist = [len(s.prompt) + 1 for s in case.workload.requests(shape.vocab_size)[:ROWS]]
    ks = KernelState(backend, shape, hist, page, states.device, torch_dtype(states.dtype))
    benchmark.group = f"decode-kernel {torch.device(states.device).type}/{states.dtype} {model_label(case.model)}"
    benchmark.extra_info.update(model=model_label(case.model), backend=backend, page_size=page, rows=len(hist),
                                history_total=sum(hist), history_max=max(hist), layers=ks.layers,
                                device=states.device, dtype=states.dtype, workload=case.workload.name)
    rounds, warmup = default_rounds(states.device)
    benchmark.pedantic(ks.step_fn(), rounds=rounds, warmup_rounds=warmup, iterations=1)


# -- ratio gates ---------------------------------------------------------------------------------------------------
def fused_vs_chunked(st: FixedState, reps: int, warmup: int = 2, plant=None) -> Ratio:
    """The ratio gate: a fused loaded step against the two chunked forwards it replaces, on the same state.
    `plant` wraps the fused step (tests only)."""
    fused = st.step_fn("loaded", "fused")
    if plant is not None:
        fused = plant(fused)
    chunked = st.step_fn("loaded", "chunked")
    return check_faster("fused loaded step (one forward)", fused, "chunked loaded step (two forwards)", chunked,
                        reps=reps, warmup=warmup, sync=st.sync)


def test_fused_loaded_step_cheaper_than_chunked(states, ratio_case):
    reason = config_reason("fused", states.device) or config_reason("chunked", states.device)
    if reason:
        pytest.skip(reason)
    case = ratio_case_for(ratio_case, states.device)
    st = states.get(case, "fused")       # chunked and fused share backend and page size: the same state
    r = fused_vs_chunked(st, reps=41 if is_cuda(states.device) else 15)
    print(f"\n{model_label(case.model)} at {case.workload.name} histories: {r}")


FLASH_VS_FLEX_HISTORY = 4096                    # "long histories": the mixed draw's longest prompt


@pytest.mark.gpu
def test_flash_decode_cheaper_than_flex(states):
    """On GPU: flash-attn's paged decode beats per-row flex (flex's 'rows' decode layout: one batch entry per
    request) at 32 requests with long histories (4096 positions each), one step's decode attention over the 1.5B
    shape's 28 layers."""
    for b in ("flash", "flex"):
        reason = backend_reason(b, states.device, kernel_page_size(b))
        if reason:
            pytest.skip(f"{b}: {reason}")
    from engine.dtypes import torch_dtype
    from engine.loader import QWEN25_1P5B, qwen2_config
    from engine.model import ModelShape
    shape = ModelShape.of(qwen2_config(**QWEN25_1P5B))
    dtype = torch_dtype(states.dtype)
    hist = [FLASH_VS_FLEX_HISTORY + 1] * ROWS
    flash = KernelState("flash", shape, hist, kernel_page_size("flash"), states.device, dtype)
    flex = KernelState("flex", shape, hist, kernel_page_size("flex"), states.device, dtype)
    if hasattr(flex.backend, "decode_layout"):
        flex.backend.decode_layout = "rows"          # one query row per request, each against its own history
    r = check_faster("flash decode", flash.step_fn(), "flex decode (one row per request)", flex.step_fn(),
                     reps=41, warmup=5, sync=flash.sync)
    print(f"\n{r}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_graphed_decode_cheaper_than_eager(states, ratio_case, kind):
    """On GPU: a captured step (one graph launch) beats the same step run eagerly, at 32 rows of the fixed state
    (pure decode; loaded: the chunk beside them; chunk-only), measured interleaved in one run."""
    names = [n for n in LINEAGE if graph_capable(n, states.device)]
    if not names:
        pytest.skip("no engine configuration captures decode graphs here (needs CUDA and a graph-safe decode "
                    "backend: flash)")
    st = states.get(ratio_case, names[0])
    if captured(st.engine.runner, kind) is None:
        pytest.skip(f"{names[0]} captures no {kind} steps here")
    forward = LINEAGE[names[0]]["forward"]
    r = check_faster(f"{names[0]} {kind} step (CUDA graph)", st.step_fn(kind, forward),
                     f"{names[0]} {kind} step (eager)", st.step_fn(kind, forward, graphs=False),
                     reps=41, warmup=3, sync=st.sync)
    print(f"\n{model_label(ratio_case.model)}: {r}")
