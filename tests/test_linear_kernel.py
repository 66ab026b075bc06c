"""kernels/linear.py, a skinny linear layer as one split-K Triton kernel whose last program of a tile adds the
splits: against the fp32 arithmetic at row counts around its row blocks, shapes that are no multiple of its blocks
and split counts that leave a short last split (one split: a skinny GEMM over the whole K); the partials unadded;
the counts back at zero after each call (a count left over, as a missing reset would leave it, is caught); the
workspace; bad arguments refused. On CPU the kernel runs in Triton's
interpreter, in a child process (tests/interpreter.py), and its GPU path is compiled to sm_90 PTX; on CUDA natively,
with --device cuda."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton", reason="the split-K linear kernel needs triton (pip install triton)")

from kernels import linear  # noqa: E402

from tests.interpreter import interpreting, kernel_test_mark, run_kernel_tests_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETING = interpreting(triton)
RUNS_HERE = DEVICE == "cuda" or INTERPRETING
kernel_test = kernel_test_mark(triton)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EPS = 1e-5


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    """This module's kernel tests, in a child process whose triton interprets (on CPU, numpy for the GPU); not the
    sm_90 compile, which needs the kernel compiled."""
    run_kernel_tests_interpreted(__file__)


def case(rows, n, k, dtype, bias: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) * k ** -0.5
    b = torch.randn(n, generator=g) if bias else None
    return x.to(DEVICE, dtype), w.to(DEVICE, dtype), None if b is None else b.to(DEVICE, dtype)


def problems(x, w, b, **tiling) -> list[str]:
    """[] when the kernel's output is within twice the error of torch's linear in the same dtype (both against
    the fp32 arithmetic), plus a tiny epsilon; else what is wrong. The output starts as NaN: a tile no program
    writes shows."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    got = linear.splitk_linear(x, w, b, out, **tiling).float()
    exact = x.float() @ w.float().T + (0 if b is None else b.float())
    base = (F.linear(x, w, b).float() - exact).abs().max().item()
    label = f"splitk_linear at {tuple(x.shape)} x {tuple(w.shape)}, bias {b is not None}, {tiling or 'its tiling'}"
    if not torch.isfinite(got).all():
        return [f"{label}: non-finite output at {torch.nonzero(~torch.isfinite(got))[:4].tolist()}"]
    err = (got - exact).abs().max().item()
    if err > 2 * base + EPS * max(1.0, exact.abs().max().item()):
        return [f"{label}: wrong values: max error {err:.3g} against the fp32 arithmetic, torch's {base:.3g}"]
    return []


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n,k,bias", [(96, 200, True), (80, 136, False), (64, 512, True)])
def test_the_kernel_matches_the_fp32_arithmetic(n, k, bias, dtype):
    """Row counts around the 16- and 32-row blocks and past them; its own tiling and splits of 1, 3 (a short last
    split where the K blocks do not divide) and more splits than K blocks allow (capped: no split left empty)."""
    found = []
    for rows in (1, 16, 17, 32, 40):
        x, w, b = case(rows, n, k, dtype, bias, seed=rows)
        for splits in (None, 1, 3, 64):
            found += problems(x, w, b, **({} if splits is None else {"splits": splits, "blocks": (16 if rows <= 16
                                                                                              else 32, 32, 32)}))
    assert not found, "\n".join(found)


@kernel_test
def test_the_partials_unadded_sum_to_the_product():
    """partials=True (session 32's probe: its consumer adds the splits) stops before the tile's last program adds
    them: [splits, M, N] fp32 sums whose total is the product; one split has no partials to give."""
    x, w, _ = case(17, 80, 136, torch.float32, False)
    part = linear.splitk_linear(x, w, splits=3, blocks=(32, 32, 32), partials=True)
    assert part.shape == (3, 17, 80)
    exact = x @ w.T
    err = (part.sum(0) - exact).abs().max().item()
    assert err < 1e-4 * exact.abs().max().item(), f"the partials sum to the product within {err}"
    with pytest.raises(ValueError, match="partials of one split"):
        linear.splitk_linear(x, w, splits=1, partials=True)


@kernel_test
def test_every_count_is_back_at_zero_after_a_call():
    """The tile's last program sets its count back: the next call (a graph's next replay) starts from zero."""
    x, w, b = case(17, 96, 200, torch.float32, True)
    linear.splitk_linear(x, w, b, splits=3, blocks=(16, 32, 32))
    counts, _ = linear.workspace(x.device, 1, 1)
    assert int(counts.abs().sum()) == 0, f"counts left after a call: {counts.tolist()}"


@kernel_test
@pytest.mark.skipif(DEVICE == "cuda", reason="a GPU runs a tile's programs at once: which partials a premature sum "
                    "reads, and the count it leaves, are a race there; the interpreter runs them in order")
def test_a_count_left_over_from_an_earlier_call_is_caught():
    """A tile whose count was not set back (a reset missed) is added up before its last split has arrived: the
    check names wrong values, and the count is not zero after the call."""
    x, w, b = case(17, 96, 200, torch.float32, True)
    linear.splitk_linear(x, w, b, splits=3, blocks=(16, 32, 32))      # the workspace made
    counts, part = linear.workspace(x.device, 1, 1)
    part.fill_(0.0)
    counts[0] = 1
    try:
        found = problems(x, w, b, splits=3, blocks=(16, 32, 32))
        assert found and "wrong values" in found[0], found
        assert int(counts.abs().sum()) > 0
    finally:
        counts.zero_()


@kernel_test
def test_the_workspace_grows_and_keeps_its_counts_zero():
    """It grows to a larger call, is reused by a smaller one, and keeps the buffers it replaced alive."""
    before, _ = linear.workspace(DEVICE, 1, 1)
    counts, part = linear.workspace(DEVICE, before.numel() + 5, 1 << 12)
    assert counts.numel() >= before.numel() + 5 and part.numel() >= 1 << 12 and int(counts.abs().sum()) == 0
    assert linear.workspace(DEVICE, 1, 1)[0] is counts, "a smaller call must reuse the workspace, not shrink it"
    assert any(c is before for c, _ in linear._RETIRED), \
        "the replaced counts were freed: a graph captured with them would write to freed memory"


def test_bad_arguments_are_refused():
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"splitk_linear: x \(4, 8\), weight \(3, 7\)"):
        linear.splitk_linear(x, torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"and bias \(2,\)"):
        linear.splitk_linear(x, torch.zeros(3, 8), torch.zeros(2))


def test_the_tiling_fills_the_device_with_whole_k_blocks():
    """The 1.5B shape's projections at 32 rows on 132 multiprocessors: enough splits for about one program each,
    none shorter than two K blocks; one row: 32-column tiles."""
    assert linear.tiling(32, 1536, 1536, 132) == (6, 32, 64, 128)       # o: 24 tiles x 6 splits
    assert linear.tiling(32, 2048, 1536, 132) == (5, 32, 64, 128)       # q/k/v: 32 tiles x 5
    assert linear.tiling(32, 1536, 8960, 132) == (6, 32, 64, 128)       # down: 24 tiles x 6
    assert linear.tiling(1, 1536, 1536, 132) == (3, 16, 32, 128)        # 48 tiles x 3
    assert linear.tiling(32, 64, 256, 132)[0] == 1                      # K of two blocks: one split


@pytest.mark.skipif(INTERPRETING, reason="the interpreter's kernels are not compiled")
def test_the_gpu_path_compiles_for_sm90_without_a_gpu():
    """The kernel as a GPU runs it, compiled through Triton's CUDA backend to PTX for sm_90, with the alignment
    hints the JIT gives 16-aligned tensors and strides (without them Triton pipelines no load): pipelined tensor-core
    dots, the count's atomic add with acquire-release order at GPU scope, the partials read from L2."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import linear_kernels
    fn = linear_kernels.splitk_linear
    sig = dict(x_ptr="*fp16", w_ptr="*fp16", b_ptr="*fp16", out_ptr="*fp16", part_ptr="*fp32", count_ptr="*i32",
               M="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    consts = dict(N=1536, K=8960, K_PER=1536, SPLITS=6, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=True,
                  REDUCE=True, PRECISION="tf32")
    hints = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a != "M"}
    compiled = triton.compile(ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                                        constexprs=consts, attrs=hints),
                              target=GPUTarget("cuda", 90, 32), options=dict(linear.LAUNCH))
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and "mma" in ptx and "cp.async" in ptx, "no pipelined tensor-core dot in the PTX"
    assert "atom.global.gpu.acq_rel.add" in ptx, "the count's atomic add is not acquire-release at GPU scope"
    assert "ld.global.cg" in ptx, "the partials are not read from L2"
    assert compiled.metadata.num_warps == linear.LAUNCH["num_warps"]
