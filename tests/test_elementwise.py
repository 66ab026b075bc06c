"""The compiled elementwise pieces (engine/layer_kernels.py): only the token dimension is dynamic, so the generated kernels
index with constant hidden sizes, and the engine's warm-up compiles every kernel a step needs (none in a later step,
none during a CUDA graph capture, where a compile fails). Checked on CPU through a torch.compile backend that records
Dynamo's graphs and runs them as they are."""
from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, RequestSpec
from engine import layer_kernels as M
from engine.model import ModelShape, Qwen2
from engine.loader import load_model



class Recorder:
    """Keeps each graph's inputs as Dynamo traced them (fake tensors, with symbolic sizes where it is dynamic)."""

    def __init__(self):
        self.inputs = []

    def __call__(self, gm, example_inputs):
        self.inputs.append([n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward


@pytest.fixture
def recorder(monkeypatch):
    M.reset_compiled_ops()
    torch._dynamo.reset()
    rec = Recorder()
    monkeypatch.setattr(M, "COMPILE_BACKEND", rec)
    yield rec
    M.reset_compiled_ops()
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def small():
    return load_model("small", torch.float32, "cpu")


def _symbolic_dims(inputs):
    """[(input index, dim)] of the tensor inputs' symbolic sizes."""
    return [(i, d) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)
            for d, n in enumerate(t.shape) if isinstance(n, torch.SymInt)]


def _serve(engine, lens, new_tokens=4):
    g = torch.Generator().manual_seed(1)
    specs = [RequestSpec(f"r{i}", torch.randint(3, 1000, (n,), generator=g).tolist(), new_tokens)
             for i, n in enumerate(lens)]
    engine.run(specs)
    return {rid: list(r.output) for rid, r in engine.requests.items()}


def test_engine_warmup_compiles_every_kernel_with_only_tokens_dynamic(recorder, small):
    """An engine with the pieces compiled serves prompts of many lengths (chunks, loaded steps, decode steps of
    several row counts) and compiles nothing after its construction; every symbolic size is a first dimension (a
    token count, or the caches' slot count for rope_write, which writes them); the tokens are the eager engine's.
    The CPU's torch backend appends no K/V in its decode, so the rotary piece alone is not compiled: the norm, the
    norm with the residual add, rope_write and SiLU-mul."""
    cfg = dict(chunk_tokens=48, num_pages=128)
    compiled = Engine(EngineConfig(compile_elementwise=True, **cfg), loaded=small)
    warm = len(recorder.inputs)
    assert warm == 8, f"expected two graphs (one token, any count) for each of 4 pieces, got {warm}"
    got = _serve(compiled, [5, 30, 70, 9, 130])
    assert len(recorder.inputs) == warm, "a step compiled a piece again after the engine's warm-up"
    for g in recorder.inputs:
        for i, d in _symbolic_dims(g):
            assert d == 0, f"a hidden size is symbolic: input {i} {tuple(g[i].shape)}"
    # each piece's any-count graph, and rope_write's one-token graph too (its caches' slot count is any)
    assert sum(bool(_symbolic_dims(g)) for g in recorder.inputs) == 5
    s = small[0].shape
    slots = [t.shape[0] for g in recorder.inputs for t in g if isinstance(t, torch.Tensor) and t.dim() == 3
             and tuple(t.shape[1:]) == (s.num_kv_heads, s.head_dim)]     # rope_write's caches, flat
    assert len(slots) == 4 and all(isinstance(n, torch.SymInt) for n in slots), (
        f"rope_write's caches compiled for one slot count (a kernel per pool or page size): {slots}")
    eager = Engine(EngineConfig(compile_elementwise=False, **cfg), loaded=small)
    assert _serve(eager, [5, 30, 70, 9, 130]) == got
    assert len(recorder.inputs) == warm, "an eager engine's steps compiled a piece"


def test_the_pieces_are_each_runners_own(recorder, small):
    """The compiled pieces are a runner's, not the process's: an eager engine built after a compiled one (the gates
    build the eager reference configurations and the compiled flash engine in one process) runs the eager pieces,
    the compiled one keeps its own, and two compiling runners share one table (Dynamo's caches serve both)."""
    cfg = dict(chunk_tokens=48, num_pages=128)
    compiled = Engine(EngineConfig(compile_elementwise=True, **cfg), loaded=small)
    eager = Engine(EngineConfig(compile_elementwise=False, **cfg), loaded=small)
    again = Engine(EngineConfig(compile_elementwise=True, **cfg), loaded=small)
    assert eager.runner.ops is M.EAGER_OPS and eager.runner.compiled_elementwise is False
    assert compiled.runner.ops is again.runner.ops is M.compiled_ops()
    assert all(compiled.runner.ops[n] is not M.EAGER_OPS[n] for n in M.EAGER_OPS)
    before = len(recorder.inputs)
    _serve(eager, [5, 30])
    assert len(recorder.inputs) == before, "the eager engine's forward called a compiled piece"


def test_a_second_model_shape_compiles_static_widths_too(recorder, small):
    """Warm-ups for two models of different widths in one process: each compiles kernels with constant widths.
    Without marking the widths static, Dynamo's automatic dynamic shapes turn every size that changed between the
    two into a symbolic one, and its profile of them (kept in the compile cache folder, read by later processes:
    "local PGO") did the same across processes: on the H200 a cache carried from a run of the gates on the small
    model made the 1.5B shape's SiLU-mul 3.6x slower (docs/RESULTS.md)."""
    other = ModelShape(vocab_size=64, hidden_size=96, intermediate_size=200, num_layers=1, num_heads=6,
                         num_kv_heads=2, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-6, max_positions=64,
                         tie_word_embeddings=False)
    for model in (small[0], Qwen2(other)):
        assert M.try_compile_elementwise("cpu", torch.float32, model)[1] is None
    n = len(M.EAGER_OPS)      # rotary=True (the default): every piece, the rotary one alone too
    assert len(recorder.inputs) == 2 * 2 * n, f"two graphs for each of {n} pieces per model, got {len(recorder.inputs)}"
    for g in recorder.inputs:
        for i, d in _symbolic_dims(g):
            assert d == 0, f"a width is symbolic after a second model's warm-up: input {i} {tuple(g[i].shape)}"


def test_a_compiler_that_fails_falls_back_to_eager(monkeypatch, small):
    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")
    torch._dynamo.reset()
    monkeypatch.setattr(M, "COMPILE_BACKEND", broken)
    try:
        ops, why = M.try_compile_elementwise("cpu", torch.float32, small[0])
        assert why is not None and "no compiler here" in why
        assert ops is M.EAGER_OPS
    finally:
        M.reset_compiled_ops()
        torch._dynamo.reset()


def test_bench_byte_counts_and_no_cuda(capsys):
    """bench.elementwise's bandwidth figures divide by the bytes each piece must move; without CUDA it says so."""
    from scripts.probes import elementwise
    s = ModelShape(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=1, num_heads=6, num_kv_heads=2,
                     head_dim=8, rope_theta=1e4, rms_norm_eps=1e-6, max_positions=64, tie_word_embeddings=False)
    args = elementwise._inputs(s, 4, "cpu", torch.float16)
    x, nbytes = args["silu_mul"]
    assert nbytes == x[0].numel() * 2 * 3 // 2      # read gate and up, write their product: 1.5x the input
    x, nbytes = args["rope"]
    assert nbytes == 2 * (2 * x[0].numel() + x[1].numel() + x[2].numel())   # q, k read and written; cos, sin read
    if not torch.cuda.is_available():
        assert elementwise.main(["--tokens", "4"]) == 2
        assert "needs CUDA" in capsys.readouterr().err



def _cache_buffers(fn):
    """(output, caches, the eager function's output and caches, the buffers shaped like a cache that the code
    Inductor generates for `fn` allocates): rope_write's arguments with odd sizes (5 pages of 24 slots, 3 key/value
    heads of 40), compiled on this CPU by Inductor itself."""
    import re

    from torch._inductor.utils import run_and_get_code
    g = torch.Generator().manual_seed(0)
    pages, page_size, kvh, d, heads, T = 5, 24, 3, 40, 6, 7
    qkv = torch.randn(T, heads + 2 * kvh, d, generator=g)
    cos, sin = torch.randn(T, d, generator=g), torch.randn(T, d, generator=g)
    slots = torch.tensor([3, 50, 7, 99, 0, 119, 64])
    caches = [torch.randn(pages, page_size, kvh, d, generator=g) for _ in "kv"]
    ref = [c.clone() for c in caches]
    want = M.rope_write(qkv, cos, sin, *(c.view(-1, kvh, d) for c in ref), slots)
    torch._dynamo.reset()
    try:
        with torch.inference_mode():      # the caches as the model passes them: flat views
            got, code = run_and_get_code(torch.compile(fn, fullgraph=True, backend="inductor"), qkv, cos, sin,
                                         *(c.view(-1, kvh, d) for c in caches), slots)
    finally:
        torch._dynamo.reset()
    shape = rf"\(({pages}, {page_size}|{pages * page_size}), {kvh}, {d}\)"
    return got, caches, want, ref, re.findall(r"empty_strided\w*\(" + shape, "\n".join(code))


def test_rope_write_compiled_writes_the_caches_in_place():
    """rope_write under Inductor (as the engine compiles it on CUDA) writes each forward's keys and values into the
    caches themselves: a copy of a cache a layer would move the whole pool every step (on the 1.5B shape, GBs a
    layer). The generated code allocates no cache-shaped buffer, and the result and both caches equal eager's.
    The check is shown to see a copy: a function that keeps the cache as it was before the write (so Inductor must
    copy it; a clone that is only copied back it elides)."""
    got, caches, want, ref, copies = _cache_buffers(M.rope_write)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(caches, ref))
    assert not copies, f"the compiled rope_write allocates cache-shaped buffers: {copies}"

    def keeps_the_old_cache(qkv, cos, sin, k_cache, v_cache, slots):
        old = k_cache.clone()
        return M.rope_write(qkv, cos, sin, k_cache, v_cache, slots), old
    got, caches, want, ref, copies = _cache_buffers(keeps_the_old_cache)
    assert torch.equal(got[0], want) and all(torch.equal(a, b) for a, b in zip(caches, ref))
    assert copies, "a copy of a cache went unseen"
