"""CUDA-graph gates: an engine that replays captured steps (pure decode steps per row count and table width; loaded
and chunk-only steps per token-count bucket, where the forward is fused and the backend's prefill is graph-safe)
emits the same tokens, at the same steps, as the same engine run eagerly (graphs off), under the 0.02 rule; both
runs are in poison mode, so a graph's output passes the same finiteness check as an eager step's. Every step of a
captured kind must have replayed its graph. Candidates are those of CANDIDATES whose decode can be captured (the
`flash` backend); elsewhere these gates skip with the reason. The planted stale-metadata bugs that these gates must
catch are in tests/test_graph_buffers.py and tests/test_step_graphs.py."""
from __future__ import annotations

import pytest

from engine import Engine
from engine.config import lineage_config

from .compare import compare
from .conftest import CANDIDATES, skip_unless_runs, workload_for
from .reference import EngineReference
from .test_tokens import assert_gate


def skip_unless_graphs(opts, engine, backend):
    skip_unless_runs(opts, engine, backend)
    try:
        ok = Engine.use_cuda_graphs(lineage_config(engine, backend=backend, device=opts.device, cuda_graphs=True))
    except ValueError as e:
        pytest.skip(str(e))
    assert ok


@pytest.mark.gpu
@pytest.mark.parametrize("workload", ["mixed-cpu", "uniform-cpu"])
@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_graphs_on_vs_off(runs, opts, engine, backend, workload):
    skip_unless_graphs(opts, engine, backend)
    workload = workload_for(opts, workload)
    eager, _ = runs.candidate(engine, backend, workload, cuda_graphs=False)
    graphed, eng = runs.candidate(engine, backend, workload, cuda_graphs=True)
    g, sg = eng.runner.graphs, eng.runner.step_graphs
    assert g is not None and g.replays > 0, "the graphed run replayed no CUDA graph: this gate tested nothing"
    pure = sum(s.kind == "pure-decode" for s in eng.trace)
    assert g.replays == pure, f"{g.replays} graph replays for {pure} pure decode steps"
    if eng.config.forward == "fused" and getattr(eng.runner.backend, "graph_safe_prefill", False):
        mixed = sum(s.kind in ("loaded", "chunk-only") for s in eng.trace)
        assert sg is not None and sg.replays == mixed > 0 and sg.fallbacks == 0, (
            f"{sg and sg.replays} step graph replays ({sg and sg.fallbacks} run eagerly) for {mixed} loaded and "
            f"chunk-only steps")
    scorer = EngineReference(engine, device=opts.device, dtype=opts.dtype, loaded=runs.loaded, backend=backend,
                             cuda_graphs=False)
    report = compare(f"{engine}[{backend}] graphs on vs off on {workload}", eager, graphed, scorer.score,
                     opts.threshold, opts.flip_cap, check_steps=True)
    assert_gate(report)
