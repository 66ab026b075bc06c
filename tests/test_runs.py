"""The gates' memoised candidate runs (gates/runs.py): one run per configuration that runs, not per spelling of it."""
from __future__ import annotations

from gates.options import gate_options
from gates.runs import Runs


def test_overrides_that_resolve_alike_share_one_run_and_others_do_not(request, monkeypatch):
    """On a CPU overlap is off unless asked for, so `cuda_graphs=True` and `cuda_graphs=True, overlap=False` are one
    configuration (one run, one engine); `repeat` and a setting that changes what runs (graphs off, overlap on) are
    runs of their own, and every use of a shared run is still checked (a later caller's label)."""
    from gates import runs as runs_module
    checked = []
    check = runs_module.check_engine
    monkeypatch.setattr(runs_module, "check_engine", lambda e, label: (checked.append((e, label)), check(e, label)))
    runs = Runs(gate_options(request.config))
    shared = runs.candidate("fused", "torch", "smoke-cpu", cuda_graphs=True)
    assert runs.candidate("fused", "torch", "smoke-cpu", cuda_graphs=True, overlap=False) is shared
    assert runs.candidate("fused", "torch", "smoke-cpu", cuda_graphs=True, overlap=False, repeat=1) is not shared
    eager = runs.candidate("fused", "torch", "smoke-cpu", cuda_graphs=False)
    assert eager is not shared and not eager[1].config.cuda_graphs
    ahead = runs.candidate("fused", "torch", "smoke-cpu", cuda_graphs=True, overlap=True)
    assert ahead is not shared and ahead[1].steps_ahead > 0 == shared[1].steps_ahead
    assert len(runs.cache) == 4
    assert checked[:2] == [(shared[1], "fused[torch] on smoke-cpu {'cuda_graphs': True}"),
                           (shared[1], "fused[torch] on smoke-cpu {'cuda_graphs': True, 'overlap': False}")]


def test_a_refused_request_takes_no_run_of_the_configuration_it_falls_back_from(request):
    """`cuda_graphs=True` where the backend runs no captured steps' path (FlexAttention off CUDA) resolves like the
    eager configuration, but the engine refuses it: the gate gets the refusal, not a run made without graphs."""
    import pytest
    from engine.errors import ConfigError
    runs = Runs(gate_options(request.config))
    eager = runs.engine_reference("fused", "flex", "smoke-cpu", cuda_graphs=False)
    runs.cache[(eager.config.resolved(), "smoke-cpu", 0)] = "the eager run"
    assert runs.engine_reference("fused", "flex", "smoke-cpu", cuda_graphs=True).config.resolved() == \
        eager.config.resolved()
    with pytest.raises(ConfigError, match="cuda_graphs=True but"):
        runs.candidate("fused", "flex", "smoke-cpu", cuda_graphs=True)
