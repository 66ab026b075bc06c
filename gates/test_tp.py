"""Tensor-parallel gates: the engine at tp N (--tp N; 2 when not given) against the same engine at tp 1 on one
device, step by step under the 0.02 rule; after the run, every rank's pages (poisoned where free, the null page
zero) and the rank-agreement check having covered every sampled row on every worker rank. tp 4 (slow) replicates the
small model's two key/value heads. Under --tp N the token gates (gates/test_tokens.py) also run every candidate at
tp N against the same tp 1 goldens."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from engine.scheduler import StepKind
from engine.workload import get_workload

from .runs import assert_gate, skip_unless_runs, workload_for
from .tp import tp_vs_tp1

# its ranks span GPUs that other xdist workers gate on, and on a CPU its rank processes would share the cores
pytestmark = pytest.mark.serial

SUBSET = 8    # the first requests of the mixed draw: long prompts read in chunks beside decoders, then decoding


@pytest.mark.tp_ranks(None)
@pytest.mark.parametrize("engine,backend", [("fused", "torch"), ("flash", "flash")], ids=["fused-torch", "flash-flash"])
def test_tp_matches_tp1_step_by_step(runs, opts, engine, backend):
    gate_tp_vs_tp1(runs, opts, engine, backend, opts.tp if opts.tp > 1 else 2)


@pytest.mark.slow
@pytest.mark.tp_ranks(4)
def test_tp4_with_replicated_kv_heads_matches_tp1(runs, opts):
    """More ranks than the small model's two key/value heads: each is replicated on two ranks."""
    if runs.loaded[0].shape.num_kv_heads >= 4:
        pytest.skip("the model has at least 4 key/value heads: nothing is replicated at tp 4")
    gate_tp_vs_tp1(runs, opts, "fused", "torch", 4)


@pytest.mark.tp_ranks(2)
@pytest.mark.parametrize("engine,backend", [("fused", "torch"), ("flash", "flash")], ids=["fused-torch", "flash-flash"])
def test_a_refused_tp_configuration_stops_its_workers(runs, opts, engine, backend):
    """overlap=True at tp > 1 is refused (ConfigError: a step launched ahead would run on rank 0 alone) once the
    worker ranks run, so the refusal must stop them, at once: a server that retries a configuration it got wrong
    must not gather orphan processes (on CUDA each holding a GPU's memory). Checked while the refusal is still held
    (as a server's log keeps it): nothing but the engine's own close stops them then."""
    from engine.errors import ConfigError
    skip_unless_runs(opts, engine, backend)
    if opts.device.startswith("cuda") and torch.cuda.device_count() < 2:
        pytest.skip(f"tp=2 needs 2 GPUs; {torch.cuda.device_count()} visible")
    before = {p.pid for p in multiprocessing.active_children()}
    ref = runs.engine_reference(engine, backend, workload_for(opts, "mixed-cpu"), tp=2, overlap=True)
    with pytest.raises(ConfigError, match="every rank would have to launch it") as refused:
        ref.engine()
    left = [f"{p.name} (pid {p.pid})" for p in multiprocessing.active_children() if p.pid not in before]
    assert not left, f"{engine}[{backend}] at tp 2 refused overlap=True ({refused.value}), but its worker ranks " \
                     f"still run: {', '.join(left)}"


def gate_tp_vs_tp1(runs, opts, engine, backend, tp):
    skip_unless_runs(opts, engine, backend)
    if opts.device.startswith("cuda") and torch.cuda.device_count() < tp:
        pytest.skip(f"tp={tp} needs {tp} GPUs; {torch.cuda.device_count()} visible")
    wl = get_workload(workload_for(opts, "mixed-cpu"))
    specs = wl.requests(runs.loaded[0].shape.vocab_size)[:SUBSET]
    report, ranks, eng = tp_vs_tp1(specs, tp, opts.threshold, opts.flip_cap, engine=engine, loaded=runs.loaded,
                                   device=opts.device, dtype=opts.dtype, backend=backend,
                                   chunk_tokens=wl.chunk_tokens)
    kinds = {s.kind for s in eng.trace}
    assert {StepKind.LOADED, StepKind.PURE_DECODE} <= kinds, \
        f"the subset should make loaded and pure decode steps; made {sorted(map(str, kinds))}"
    assert not ranks, f"tp={tp}: " + "\n  ".join(ranks)
    assert_gate(report)
