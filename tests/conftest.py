"""Fixtures shared by tests/: where captured steps are tested."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from kernels import why_unavailable
from kernels.torch_backend import TorchBackend


def emulate_graphs(monkeypatch, prefill: bool) -> None:
    """Off CUDA: let an engine "capture" with the torch backend (nothing is captured; a replay runs the same forward
    over the same static buffers). Its decode reads the table's whole width masked by the device lengths, and its
    prefill the widths the host bounds give: correct, but on the 1.5B shape 32k positions a row, which is why it is
    not marked graph-safe for real use. `prefill`: loaded and chunk-only steps too, not only pure decode ones."""
    monkeypatch.setattr(TorchBackend, "graph_safe_decode", True)
    monkeypatch.setattr(TorchBackend, "graph_safe_prefill", prefill)
    monkeypatch.setattr(Engine, "use_cuda_graphs", staticmethod(lambda config: bool(config.cuda_graphs)))


@pytest.fixture(scope="session")
def graph_emulation():
    """emulate_graphs(monkeypatch, prefill), for tests that build an emulating engine themselves."""
    return emulate_graphs


@pytest.fixture(params=["cpu-emulated", pytest.param("cuda", marks=pytest.mark.gpu)])
def graph_mode(request, monkeypatch) -> dict:
    """`cuda` (with --device cuda and flash-attn): real graphs, flash, fp16, the trained small model, whose margins
    outlast fp16 rounding (docs/small-model.md). `cpu-emulated`: the torch backend on the small model in fp32,
    emulating loaded and chunk-only steps too where the test module sets EMULATE_STEP_GRAPHS = True."""
    if request.param == "cuda":
        dev = request.config.getoption("--device")
        if not dev.startswith("cuda") or not torch.cuda.is_available():
            pytest.skip("captured CUDA graphs need a CUDA device (run with --device cuda on a GPU)")
        reason = why_unavailable("flash", dev, 256)
        if reason:
            pytest.skip(f"no graph-safe backend here: flash: {reason}")
        return dict(engine="flash", device=dev, dtype="float16", model="small-trained")
    emulate_graphs(monkeypatch, getattr(request.module, "EMULATE_STEP_GRAPHS", False))
    return dict(engine="fused", device="cpu", dtype="float32", model="small")


@pytest.fixture(scope="module")
def one_torch_thread():
    """The small model's forwards are tiny: on a shared 2-core machine torch's second intra-op thread makes each step
    up to ~100x slower (spinning against other processes). One thread for the module, restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def loaded():
    """The small model, loaded once per module: (model, hf config, name)."""
    from engine.loader import load_model
    return load_model(None, torch.float32, "cpu")


@pytest.fixture
def gate_folder(pytester):
    """make(conftest, **gate_files): a synthetic gate folder for pytester runs (an empty golden/, gates/ holding the
    files given, markers as the project registers them), whose conftest loads the stepgate plugins it names."""
    def make(conftest: str, **gate_files: str):
        pytester.makeconftest(conftest)
        pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
        (pytester.path / "golden").mkdir()
        (pytester.path / "gates").mkdir()
        for name, text in gate_files.items():
            (pytester.path / "gates" / name).write_text(text)
        return pytester
    return make
