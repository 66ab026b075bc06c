"""The compiled elementwise pieces (engine/model.py): only the token dimension is dynamic, so the generated kernels
index with constant hidden sizes, and the warm-up compiles every kernel a step needs (no compile in a later step,
none during a CUDA graph capture). Checked on CPU through a backend that records Dynamo's graphs."""
from __future__ import annotations

import pytest
import torch

from engine import model as M

SHAPE = M.ModelShape(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=1, num_heads=6,
                     num_kv_heads=2, head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6, max_positions=64,
                     tie_word_embeddings=False)


class Recorder:
    """A torch.compile backend that keeps each graph's inputs as Dynamo traced them (fake tensors, whose sizes are
    symbolic where the graph is dynamic) and runs the graph as it is."""

    def __init__(self):
        self.inputs = []

    def __call__(self, gm, example_inputs):
        self.inputs.append([n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward


@pytest.fixture
def recorder():
    torch._dynamo.reset()
    rec = Recorder()
    yield rec
    M.compile_elementwise(False)
    torch._dynamo.reset()


def _symbolic_dims(inputs):
    """[(input index, dim)] of the tensor inputs' symbolic sizes."""
    return [(i, d) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)
            for d, n in enumerate(t.shape) if isinstance(n, torch.SymInt)]


def test_warmup_marks_only_the_token_dimension_dynamic(recorder):
    assert M.try_compile_elementwise("cpu", torch.float32, SHAPE, backend=recorder) is None
    # four pieces, each a graph for one token (specialised) and one for any other count
    assert len(recorder.inputs) == 8
    dynamic = [g for g in recorder.inputs if _symbolic_dims(g)]
    assert len(dynamic) == 4
    for g in dynamic:
        tensors = [t for t in g if isinstance(t, torch.Tensor)]
        # every symbolic size is a token dimension (dim 0 of a [T, ...] input); weights and widths stay constant
        for i, d in _symbolic_dims(g):
            assert d == 0 and g[i].dim() >= 2, f"a hidden size is symbolic: input {i} {tuple(g[i].shape)}"
        assert all(isinstance(n, int) for t in tensors for n in t.shape[1:])


def test_steps_after_the_warmup_compile_nothing(recorder):
    M.try_compile_elementwise("cpu", torch.float32, SHAPE, backend=recorder)
    warm = len(recorder.inputs)
    torch.manual_seed(0)
    s = SHAPE
    for T in (1, 5, 17, 300):
        x, r = torch.randn(T, s.hidden_size), torch.randn(T, s.hidden_size)   # never the same tensor in a model
        w = torch.ones(s.hidden_size)
        out = M.OPS["add_rms_norm"](x, r, w, 1e-6)[0]
        torch.testing.assert_close(out, M.rms_norm(x + r, w, 1e-6))
        qkv = torch.randn(T, s.num_heads + 2 * s.num_kv_heads, s.head_dim)
        cos, sin = torch.randn(T, s.head_dim), torch.randn(T, s.head_dim)
        torch.testing.assert_close(M.OPS["rope"](qkv[:, :s.num_heads + s.num_kv_heads], cos, sin),
                                   M.rope(qkv[:, :s.num_heads + s.num_kv_heads], cos, sin))
        gu = torch.randn(T, 2 * s.intermediate_size)
        torch.testing.assert_close(M.OPS["silu_mul"](gu), M.silu_mul(gu))
        M.OPS["rms_norm"](x, w, 1e-6)
    assert len(recorder.inputs) == warm, "a step after the warm-up compiled again"


def test_a_compiler_that_fails_falls_back_to_eager():
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")
    torch._dynamo.reset()
    try:
        why = M.try_compile_elementwise("cpu", torch.float32, SHAPE, backend=broken)
        assert why is not None and "no compiler here" in why
        assert all(M.OPS[n] is M._EAGER[n] for n in M.OPS)
    finally:
        M.compile_elementwise(False)
        torch._dynamo.reset()


def test_bench_byte_counts_and_no_cuda(capsys):
    """bench.elementwise's bandwidth figures divide by the bytes each piece must move; without CUDA it says so."""
    from bench import elementwise
    args = elementwise._inputs(SHAPE, 4, "cpu", torch.float16)
    x, nbytes = args["silu_mul"]
    assert nbytes == x[0].numel() * 2 * 3 // 2      # read gate and up, write their product: 1.5x the input
    x, nbytes = args["rope"]
    assert nbytes == 2 * (2 * x[0].numel() + x[1].numel() + x[2].numel())   # q, k read and written; cos, sin read
    if not torch.cuda.is_available():
        assert elementwise.main(["--tokens", "4"]) == 2
        assert "needs CUDA" in capsys.readouterr().err
