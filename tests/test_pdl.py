"""Programmatic dependent launch (EngineConfig.pdl; kernels/pdl.py, kernels/pdl_kernels.py) on a CPU: the
configuration refuses it where it cannot run and names it in the served key where it runs, the forward hands it to
every layer kernel with its prefetch, the runner and backend are built as configured (the served check names a
build that is not), and the launch arguments add nothing without it. That each kernel compiles to launch_dependents,
its prefetches and the wait, in that order, is tested per kernel on CPU (tests/test_linear_kernel.py,
tests/test_mlp_kernel.py, tests/test_triton_decode.py: the sm_90 compile tests); on the GPU gates/test_graphs.py's
PDL gate runs the captured steps with it against without (the plant `pdl-no-wait` fails it)."""
from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig, lineage_config
from engine.errors import ConfigError
from kernels import pdl


def test_the_configuration_refuses_pdl_where_it_cannot_run_and_names_it_where_it_runs():
    cfg = lineage_config("flash", device="cpu")
    assert cfg.resolved().pdl is False and "pdl" not in cfg.resolved().key()
    with pytest.raises(ConfigError, match=r"pdl=True on cpu: programmatic dependent launch is a CUDA feature"):
        EngineConfig(pdl=True)
    with pytest.raises(ConfigError, match=r"pdl='yes': must be True or False \(or None: automatic\)"):
        EngineConfig(pdl="yes")
    assert EngineConfig(pdl=False).resolved().pdl is False
    on = SimpleNamespace(**{**asdict(cfg.resolved()), "mlp_kernel": "triton", "pdl": True})
    assert EngineConfig.key(on).endswith("/tp1/mlp-triton/pdl")


def test_no_launch_argument_without_pdl():
    """A kernel launched without PDL compiles and launches exactly as before PDL existed."""
    assert pdl.pdl_args(False, 512) == {}
    assert pdl.pdl_args(True) == {"PDL": True, "launch_pdl": True}
    assert pdl.pdl_args(True, 512) == {"PDL": True, "launch_pdl": True, "PREFETCH": 512}
    assert "CUDA" in pdl.why_unavailable("cpu")


def test_the_forward_hands_pdl_and_the_prefetch_to_each_layer_kernel(monkeypatch):
    """ForwardContext.pdl reaches the split-K projections and the fused MLP kernel with kernels.pdl's prefetch counts
    (0 as measured: here set to others, so that a count not passed on shows), as the runner's layer_kernels() passes
    it."""
    from kernels import linear, mlp
    from tests.tiny_model import tiny_forwards
    calls = []

    def fake_linear(x, w, b=None, pdl=False, prefetch=0):
        calls.append(("linear", pdl, prefetch))
        return F.linear(x, w, b)

    def fake_mlp(x, w, pdl=False, prefetch=0):
        calls.append(("mlp", pdl, prefetch))
        return mlp.reference(x, w)
    monkeypatch.setattr(pdl, "LINEAR_PREFETCH", 1536)
    monkeypatch.setattr(pdl, "MLP_PREFETCH", 512)
    monkeypatch.setattr(linear, "splitk_linear", fake_linear)
    monkeypatch.setattr(mlp, "gate_up_silu", fake_mlp)
    for on in (False, True):
        calls.clear()
        tiny_forwards("cpu", [(8, on, dict(linear_rows=32, mlp_rows=32, pdl=on))])
        want = {("linear", on, 1536), ("mlp", on, 512)}
        assert set(calls) == want and len(calls) == 2 * 4, f"pdl={on}: the layer kernels were called {calls}"


def test_a_runner_or_backend_built_against_the_configuration_fails_the_served_check():
    """gates/dispatch.served_problems (every gate run's served check): a runner or a backend launching with PDL
    where the configuration says off is named, each by what it launches."""
    from gates.dispatch import served_problems
    from gates.reference import EngineReference
    engine = EngineReference("fused", "small", device="cpu", cuda_graphs=False, progress=False).engine()
    assert engine.runner.pdl is False and engine.runner.backend.pdl is False
    assert not [p for p in served_problems(engine) if "pdl" in p]
    engine.runner.pdl = True
    assert "served: pdl=False is configured, the runner's layer kernels launch with programmatic dependent launch" \
        in served_problems(engine)
    engine.runner.pdl = False
    engine.runner.backend.pdl = True
    assert any(p.startswith("served: pdl=False is configured, the torch backend's decode launch with")
               for p in served_problems(engine))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_device_says_whether_it_can():
    """On a GPU: sm_90 and later can (with this Triton); the configuration's None follows PDL_DEFAULT there."""
    from engine.config import PDL_DEFAULT
    major, _ = torch.cuda.get_device_capability()
    assert (pdl.why_unavailable("cuda") is None) == (major >= 9)
    assert EngineConfig(device="cuda").resolved().pdl == (PDL_DEFAULT and major >= 9)
