"""The smoke gate, run first: a few requests whose prompts end at page boundaries (64; 256 where flash decodes) and
prompt chunk boundaries, with short budgets, through every engine configuration against the `hf` golden under the
0.02 rule, in poison mode. It takes seconds, so a bug that changes numbers fails the run before the long gates start.
Its goldens are per device like every other's: a missing one fails with the command that makes it."""
from __future__ import annotations

import pytest

from engine.workload import SMOKE_CPU

from . import summary, triage
from .compare import compare
from .conftest import CANDIDATES, skip_unless_runs, workload_for
from .reference import LazyReference


@pytest.mark.parametrize("engine,backend", CANDIDATES, ids=[f"{e}-{b}" for e, b in CANDIDATES])
def test_smoke(runs, opts, engine, backend):
    skip_unless_runs(opts, engine, backend)
    workload = workload_for(opts, SMOKE_CPU.name)
    golden = runs.golden("hf", workload)
    cand, eng = runs.candidate(engine, backend, workload)
    # the hf model is loaded only if a flip needs teacher forcing (or a failure its triage)
    score = LazyReference(lambda: runs.reference("hf", workload)).score
    report = compare(f"smoke: {engine}[{backend}] vs hf on {workload}", golden, cand, score, opts.threshold,
                     opts.flip_cap, check_steps=False)
    summary.record(report)
    assert report.ok, triage.failure_message(report, eng, golden, score)
