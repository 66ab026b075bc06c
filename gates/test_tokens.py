"""Token gates: every engine configuration against the `hf` golden, each generation against its predecessor step by
step, the loaded step shape on its own, and determinism. All runs are in poison mode (freed and never-written
slots hold NaN), so these are also the freed-page gates for every backend in CANDIDATES."""
from __future__ import annotations

import pytest

from engine.config import PREDECESSOR
from engine.scheduler import StepKind
from engine.workload import get_workload

from .compare import compare
from .reference import LazyReference
from .runs import CANDIDATES, assert_gate, skip_unless_runs, workload_for

WORKLOADS = ["mixed-cpu", "uniform-cpu"]


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_against_hf(runs, opts, engine, backend, workload):
    """The engine's greedy tokens equal transformers' own, or differ only at near ties (0.02 rule)."""
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, workload)
    golden = runs.golden("hf", workload)
    cand, eng = runs.candidate(engine, backend, workload)
    assert eng.pool.num_free == eng.pool.capacity, "pages leaked: the pool is not whole after the run"
    # made at the first flip: a run with none never loads transformers' model (nor imports transformers)
    score = LazyReference(lambda: runs.reference("hf", workload)).score
    report = compare(f"{engine}[{backend}] vs hf on {workload}", golden, cand, score, opts.threshold, opts.flip_cap,
                     check_steps=False)
    assert_gate(report, eng, golden, score)


@pytest.mark.parametrize("engine,backend", [c for c in CANDIDATES if c[0] in PREDECESSOR],
                         ids=[f"{e}-{b}" for e, b in CANDIDATES if e in PREDECESSOR])
def test_against_predecessor(runs, opts, engine, backend):
    """Each generation against the one before it on the same workload, step by step: same tokens at the same
    steps (they share a scheduler), flips only at near ties."""
    skip_unless_runs(opts, engine, backend)
    pred = PREDECESSOR[engine]
    workload = workload_for(opts, "mixed-cpu")
    golden = runs.golden(pred, workload)
    cand, eng = runs.candidate(engine, backend, workload)
    # the same scheduler only when the page size matches; otherwise admission (and so the steps) may differ
    same_pages = runs.reference(pred, workload).config.page_size == runs.candidate(engine, backend, workload)[1] \
        .config.page_size
    report = compare(f"{engine}[{backend}] vs {pred} on {workload}", golden, cand,
                     runs.reference(pred, workload).score, opts.threshold, opts.flip_cap, check_steps=same_pages)
    assert_gate(report, eng, golden, runs.reference(pred, workload).score)


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_loaded_step(runs, opts, engine, backend):
    """The step shape where prompt chunks and decode tokens share one forward (engine.workload.LOADED_CPU: short
    prompts decode while long ones are read in chunks of 64), gated on its own against the stored `hf` golden."""
    skip_unless_runs(opts, engine, backend)
    from .reference import EngineReference
    workload = workload_for(opts, "loaded-cpu")
    golden = runs.golden("hf", workload)
    wl = get_workload(workload)
    cand_ref = EngineReference(engine, device=opts.device, dtype=opts.dtype, loaded=runs.loaded, backend=backend,
                               poison=True, chunk_tokens=wl.chunk_tokens, **runs.tp_overrides)
    cand = cand_ref.generate(wl.requests())
    runs.finish(cand_ref.last_engine)
    trace = cand_ref.last_engine.trace
    loaded = [s for s in trace if s.kind == StepKind.LOADED]
    assert len(loaded) >= 10, f"the workload should make loaded steps; made {len(loaded)} of {len(trace)}"
    loaded_steps = {s.index for s in loaded}
    emitted_in_loaded = sum(st in loaded_steps for r in cand.values() for st in r.steps)
    assert emitted_in_loaded >= 50, f"only {emitted_in_loaded} tokens were emitted in loaded steps"
    score = LazyReference(lambda: runs.reference("hf", workload)).score     # made at the first flip, as above
    report = compare(f"{engine}[{backend}] loaded steps vs hf", golden, cand, score, opts.threshold,
                     opts.flip_cap, check_steps=False)
    assert_gate(report, cand_ref.last_engine, golden, score)


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_determinism(runs, opts, engine, backend):
    """The same run twice gives identical tokens at identical steps."""
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, "mixed-cpu")
    first, _ = runs.candidate(engine, backend, workload)
    again, _ = runs.candidate(engine, backend, workload, repeat=1)
    diffs = [(rid, r.tokens, again[rid].tokens) for rid, r in first.items()
             if r.tokens != again[rid].tokens or r.steps != again[rid].steps]
    assert not diffs, (f"{engine}[{backend}]: {len(diffs)} requests differ between two identical runs, first "
                       f"{diffs[0][0]}: {diffs[0][1][:10]} vs {diffs[0][2][:10]}")
