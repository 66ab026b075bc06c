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
    # check against the newest baseline of this machine: a median slower by more than the given share fails
    pytest gates/test_step_timings.py --benchmark-storage=file://golden/benchmarks/<machine> \
        --benchmark-autosave --benchmark-compare --benchmark-compare-fail=median:10%
    # what regressed by how much (newest two saved runs, or --baseline/--current JSON paths)
    python -m gates.alert --storage golden/benchmarks/<machine> --markdown bench-summary.md

On GPU add `--device cuda` (fp16 by default). CI on CPU only runs this file (its absolute times are never compared
across machines); what must hold on any machine are the ratio gates below, measured in one run on one state. A stored
baseline is history (a baseline of another host reads 16% apart): the performance alert is `python -m gates.ab`,
base and head timed on these states in one job (docs/ab.md), and `python -m gates.ab refresh-baseline` refreshes a
machine's baseline.

Environment (tests only): STEPGATE_PLANT_SLOWDOWN_MS adds a sleep inside every timed step (tests/ uses it to prove
that a slowdown is caught); STEPGATE_BENCH_ROUNDS overrides the rounds per benchmark.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import LINEAGE
from engine.scheduler import WORK_KINDS

from .ratio import check_faster, fused_vs_chunked
from .step_states import (KERNEL_BACKENDS, ROWS, KernelState, States, backend_reason, captured, config_reason,
                          default_rounds, graph_capable, is_cuda, kernel_page_size, model_cases, model_label,
                          model_shape, ratio_case_for, run_device, run_dtype)

# a timing taken beside another worker's steps is noise, and pytest-benchmark turns itself off under xdist
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def states(pytestconfig):
    s = States(run_device(pytestconfig), run_dtype(pytestconfig))
    yield s
    s.close()


# -- parametrisation -----------------------------------------------------------------------------------------------
def pytest_generate_tests(metafunc):
    cfg = metafunc.config
    device = run_device(cfg)
    dev = torch.device(device).type
    cases = model_cases(cfg)
    if "step_case" in metafunc.fixturenames:
        params = [pytest.param((case, name, kind, True, None), id=f"{dev}-{model_label(case.model)}-{name}-{kind}")
                  for case in cases for name in LINEAGE for kind in WORK_KINDS]
        # the graph path's eager twin, timed in the same run (graphs are captured only where a config allows)
        params += [pytest.param((case, name, kind, False, None),
                                id=f"{dev}-{model_label(case.model)}-{name}-{kind}-eager")
                   for case in cases for name in LINEAGE if graph_capable(name, device) for kind in WORK_KINDS]
        # `fused` on the flex backend: the flash generation's predecessor kernel, beside it in the same run (GPU:
        # on CPU, flex compiles every shape with Inductor's C++ backend, too slow for this file)
        if dev == "cuda":
            params += [pytest.param((case, "fused", kind, True, "flex"),
                                    id=f"{dev}-{model_label(case.model)}-fused-flex-{kind}")
                       for case in cases for kind in WORK_KINDS]
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
                                cuda_graphs=bool(graphs and captured(st.engine.runner, kind)),
                                served=st.engine.served.key(), **info)
    rounds, warmup = default_rounds(states.device)
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=warmup, iterations=1)
    stats = getattr(benchmark, "stats", None)
    median = stats.stats.median if stats is not None and getattr(stats, "stats", None) is not None else None
    if median:
        benchmark.extra_info["tokens_per_s"] = info["tokens"] / median


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
def test_fused_loaded_step_cheaper_than_chunked(states, ratio_case):
    reason = config_reason("fused", states.device) or config_reason("chunked", states.device)
    if reason:
        pytest.skip(reason)
    case = ratio_case_for(ratio_case, states.device)
    st = states.get(case, "fused")       # chunked and fused share backend and page size: the same state
    r = fused_vs_chunked(st, reps=41 if is_cuda(states.device) else 31)
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
@pytest.mark.parametrize("kind", WORK_KINDS)
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
