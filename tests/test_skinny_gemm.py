"""kernels/skinny_gemm.py, a decode step's projections in Triton: the gate's check (gates/gemm_check.py) passes it at
the row counts and shapes it takes and fails planted bugs (a dropped bias, a dropped K block, a read past the input's
rows) with a clear message; the shapes it refuses; and an engine whose forwards take it emits the tokens of one
that does not. On CPU through Triton's interpreter, in a child process (tests/interpreter.py); natively on CUDA."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="the skinny GEMM needs triton (pip install triton)")

from engine.config import EngineConfig  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.errors import ConfigError  # noqa: E402
from gates.failure import GateFailure  # noqa: E402
from gates.gemm_check import check_linear, projection_shapes  # noqa: E402
from kernels import skinny_gemm as sg  # noqa: E402
from tests.interpreter import interpreting, kernel_test_mark, run_kernel_tests_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RUNS_HERE = DEVICE == "cuda" or interpreting(triton)
kernel_test = kernel_test_mark(triton)


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    run_kernel_tests_interpreted(__file__, deselect="nothing_compiled")


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k,bias", [(1, 48, 32, True), (7, 100, 64, False), (32, 512, 256, True),
                                        (33, 256, 512, False), (64, 33, 16, True), (17, 1024, 96, False)])
def test_matches_f_linear(m, n, k, bias, dtype):
    """Row counts inside, at and past a block; N not a multiple of the column block; K blocks of 16 to 128."""
    r = check_linear(sg.linear, m, n, k, bias, device=DEVICE, dtype=dtype)
    assert r["err"] <= r["tol"]


@kernel_test
@pytest.mark.parametrize("plant,why", [
    (lambda x, w, b: sg.linear(x, w, None), "wrong values"),                            # the bias dropped
    (lambda x, w, b: sg.linear(x[:, :-16], w[:, :-16], b), "wrong values"),             # the last K block dropped
    (lambda x, w, b: sg.linear(torch.as_strided(x, (x.shape[0] + 1, x.shape[1]), x.stride()), w, b)[1:],
     "non-finite"),                                                                     # one row past the input
])
def test_the_gate_check_fails_planted_bugs(plant, why):
    with pytest.raises(GateFailure, match=f"skinny gemm .*max error .*{why}"):
        check_linear(plant, 32, 64, 64, True, device=DEVICE, dtype=torch.float16)


def test_shapes_taken_and_refused():
    x, w = torch.zeros(64, 48), torch.zeros(10, 48)
    assert sg.supports(x, w)
    assert not sg.supports(torch.zeros(65, 48), w)                      # a prompt chunk: cuBLAS
    assert not sg.supports(torch.zeros(8, 40), torch.zeros(10, 40))     # K not a multiple of 16
    assert not sg.supports(torch.zeros(48, 8).t(), w)                   # columns not contiguous
    assert not sg.supports(x.half(), w)                                 # mixed dtypes
    # the 1.5B shape: 132 multiprocessors take 64-column blocks of gate/up's 17,920, and 16 of the others
    shapes = projection_shapes({"hidden_size": 1536, "num_attention_heads": 12, "num_key_value_heads": 2,
                                "intermediate_size": 8960})
    assert shapes == {"qkv": (2048, 1536, True), "o": (1536, 1536, False), "gate_up": (17920, 1536, False),
                      "down": (1536, 8960, False)}
    assert [sg.tiling(32, n, k) for n, k, _ in shapes.values()] == [(32, 16, 128), (32, 16, 128), (32, 64, 128),
                                                                    (32, 16, 128)]
    assert sg.tiling(1, 100, 48) == (16, 16, 16) and sg.tiling(33, 100, 64) == (64, 16, 64)


def test_refused_off_cuda():
    if DEVICE == "cuda":
        pytest.skip("CUDA takes it")
    with pytest.raises(ConfigError, match="skinny_gemm=True on device='cpu'"):
        EngineConfig(skinny_gemm=True)
    assert EngineConfig().resolved().skinny_gemm is False and "skinny" not in EngineConfig().resolved().key()


@kernel_test
def test_an_engine_on_it_emits_the_same_tokens(monkeypatch):
    """The small model's engine with its forwards' projections on the skinny GEMM (the runner's flag, as
    EngineConfig.skinny_gemm sets it on CUDA) against one on F.linear: the same tokens, and the kernel ran."""
    calls = []
    real = sg.linear
    monkeypatch.setattr(sg, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    prompts = [[5, 9, 200, 17, 3], [44] * 40, list(range(100, 170))]

    def tokens(skinny):
        if DEVICE == "cuda":        # set before the steps are captured
            e = Engine(EngineConfig(device=DEVICE, chunk_tokens=64, progress=False, skinny_gemm=skinny))
        else:                       # the config refuses it off CUDA: the runner's flag, which the config sets
            e = Engine(EngineConfig(device=DEVICE, chunk_tokens=64, progress=False))
            e.runner.skinny_gemm = skinny
        ids = [e.submit(p, 6) for p in prompts]
        e.run()
        return [e.pop_result(i).tokens for i in ids]

    plain = tokens(False)
    assert not calls
    assert tokens(True) == plain
    assert calls and max(calls) <= sg.MAX_ROWS, calls
