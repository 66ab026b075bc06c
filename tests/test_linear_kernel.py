"""kernels/linear.py, a skinny linear layer as one split-K Triton kernel whose last program of a tile adds the
splits: against the fp32 arithmetic at row counts around its row blocks, shapes that are no multiple of its blocks
and split counts that leave a short last split (one split: a skinny GEMM over the whole K); the partials unadded;
the counts back at zero after each call (a count left over, as a missing reset would leave it, is caught); the
workspace; bad arguments refused. On CPU the kernel runs in Triton's
interpreter, in a child process (tests/interpreter.py), and its GPU path is compiled to sm_90 PTX; on CUDA natively,
with --device cuda."""
from __future__ import annotations

import re
from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig, lineage_config
from engine.errors import ConfigError
from gates.linear_check import linear_case, linear_problems

triton = pytest.importorskip("triton", reason="the split-K linear kernel needs triton (pip install triton)")

from kernels import linear  # noqa: E402

from tests.tiny_model import tiny_forwards  # noqa: E402
from tests.interpreter import interpreting, kernel_test_mark, run_kernel_tests_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETING = interpreting(triton)
RUNS_HERE = DEVICE == "cuda" or INTERPRETING
kernel_test = kernel_test_mark(triton)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    """This module's kernel tests, in a child process whose triton interprets (on CPU, numpy for the GPU); not the
    sm_90 compile, which needs the kernel compiled."""
    run_kernel_tests_interpreted(__file__)


def case(rows, n, k, dtype, bias: bool, seed=0):
    return linear_case(rows, n, k, bias, dtype, DEVICE, seed)


def problems(x, w, b, **tiling) -> list[str]:
    """The kernel gate's check (gates/linear_check.py): [] when within twice the error of torch's linear in the
    same dtype (both against the fp32 arithmetic), plus a tiny epsilon; else what is wrong."""
    return linear_problems(x, w, b, **tiling)


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


@kernel_test
def test_an_off_by_one_in_the_bias_fails_the_gate_check(monkeypatch):
    """The plant `linear-bias-late` (tests/plants.py, which the GPU plant table runs against the kernel gate): each
    column gets the next column's bias. The gate's check (gates/linear_check.py, as gates/test_linear.py runs it)
    names the kernel, the projection, the shape and the error."""
    from tests.plants import PLANTS
    PLANTS["linear-bias-late"].patch(monkeypatch)
    found = linear_problems(*linear_case(17, 96, 200, True, torch.float16, DEVICE), label="(q/k/v) ")
    assert found and re.search(PLANTS["linear-bias-late"].cause, found[0]), found


@kernel_test
def test_the_model_runs_the_split_k_kernel_exactly_where_linear_rows_says(monkeypatch):
    """A forward's linear_rows (ForwardContext: the runner's, from EngineConfig.linear_kernel) sends q/k/v, o and
    down of at most that many rows to the kernel, and larger ones to F.linear; both give the same logits."""
    calls = []
    kernel = linear.splitk_linear
    monkeypatch.setattr(linear, "splitk_linear", lambda x, w, b=None, **kw: calls.append(
        (x.shape[0], tuple(w.shape), b is not None)) or kernel(x, w, b, **kw))
    took = set()
    out = tiny_forwards(DEVICE, [(rows, limit, dict(linear_rows=limit, linear_took=took)) for rows in (8, 32, 33)
                                 for limit in (0, linear.SKINNY_ROWS)])
    layer = [(((4 + 2 * 2) * 64, 256), True), ((256, 256), False), ((256, 512), False)]     # q/k/v, o, down
    assert calls == [(rows, *w) for rows in (8, 32) for _ in range(2) for w in layer], \
        f"the kernel ran {calls}: expected q/k/v, o and down of both layers at 8 and 32 rows (at linear_rows 32)"
    assert took == {(8, "torch"), (8, "triton"), (32, "torch"), (32, "triton"), (33, "torch")}, \
        f"the forwards recorded {took}"
    for rows in (8, 32, 33):
        diff = (out[rows, 0] - out[rows, linear.SKINNY_ROWS]).abs().max().item()
        assert diff < 1e-3, f"{rows} rows: logits with and without the split-K kernel differ by {diff}"


def test_the_configuration_picks_the_kernel_per_device():
    """None: torch's (F.linear) everywhere until the kernel is the default; "triton" on a CPU and an unknown kernel
    are refused, naming why; the served key names it where it runs."""
    cfg = lineage_config("flash", device="cpu")
    assert cfg.resolved().linear_kernel == "torch" and "linear" not in cfg.resolved().key()
    with pytest.raises(ConfigError, match=r"linear_kernel='triton' on cpu: it is a Triton kernel for CUDA devices"):
        EngineConfig(linear_kernel="triton")
    with pytest.raises(ConfigError, match=r"linear_kernel='cublaslt': must be one of 'torch', 'triton'"):
        EngineConfig(linear_kernel="cublaslt")
    on = SimpleNamespace(**{**asdict(cfg.resolved()), "mlp_kernel": "triton", "linear_kernel": "triton"})
    assert EngineConfig.key(on).endswith("/tp1/mlp-triton/linear-triton")


def test_a_runner_that_runs_the_kernel_unconfigured_fails_the_served_check():
    """gates/dispatch.served_problems: a runner whose forwards run the split-K kernel where the configuration says
    F.linear is named."""
    from gates.dispatch import served_problems
    from gates.reference import EngineReference
    engine = EngineReference("fused", "small", device="cpu", cuda_graphs=False, progress=False).engine()
    assert not [p for p in served_problems(engine) if "linear" in p]
    engine.runner.linear_rows = linear.SKINNY_ROWS
    problems = served_problems(engine)
    assert any("linear_kernel='torch' is configured, the runner's forwards run the projections' split-K kernel up "
               "to 32 positions (expected 0)" in p for p in problems), problems


def test_the_dispatch_check_holds_the_kernel_taken_against_the_configured_one():
    """gates/dispatch.layer_dispatch_problems for the projections (every gate engine run's dispatch check): a
    projection of at most 32 rows that took F.linear where the kernel is configured, a larger one that took the
    kernel, none recorded though a small forward ran, the kernel taken where F.linear is configured; a CPU engine's
    run records F.linear only, and its check is clean."""
    from gates.dispatch import dispatch_problems, layer_dispatch_problems
    from gates.reference import EngineReference

    def problems_of(kernel, took, steps=((0, 8), (512, 4))):
        trace = [SimpleNamespace(prompt_positions=p, decode_tokens=d) for p, d in steps]
        e = SimpleNamespace(runner=SimpleNamespace(linear_dispatched=set(took)), trace=trace,
                            served=SimpleNamespace(linear_kernel=kernel, forward="fused"))
        return layer_dispatch_problems(e, "linear_kernel")
    right = {(8, "triton"), (32, "triton"), (33, "torch"), (516, "torch")}
    assert problems_of("triton", right) == []
    assert problems_of("triton", {(8, "torch"), (516, "torch")}) == [
        "dispatch: linear_kernel='triton' is configured (the split-K kernel up to 32 rows), but projections of 8 "
        "rows took torch"]
    assert problems_of("triton", {(32, "torch")}) and problems_of("triton", {(33, "triton")})
    assert problems_of("triton", {(516, "torch")}) == [
        "dispatch: linear_kernel='triton' is configured and 1 forward(s) of at most 32 positions ran, but no "
        "projection of that size was recorded"]
    assert problems_of("torch", right) == [
        "dispatch: projections of [8, 32] rows ran the split-K kernel, but linear_kernel='torch' is configured"]
    e = EngineReference("fused", "small", device="cpu", cuda_graphs=False, progress=False).engine()
    e.submit(list(range(3, 40)), 4, "r0")
    e.run()
    assert {kernel for _, kernel in e.runner.linear_dispatched} == {"torch"}
    assert not [p for p in dispatch_problems(e) if "projection" in p]


@pytest.mark.skipif(INTERPRETING, reason="the interpreter's kernels are not compiled")
@pytest.mark.parametrize("pdl", [False, True])
def test_the_gpu_path_compiles_for_sm90_without_a_gpu(pdl):
    """The kernel as a GPU runs it, compiled through Triton's CUDA backend to PTX for sm_90, with the alignment
    hints the JIT gives 16-aligned tensors and strides (without them Triton pipelines no load): pipelined tensor-core
    dots, the count's atomic add with acquire-release order at GPU scope, the partials read from L2. With PDL
    (kernels/pdl_kernels.py): the program's weight rows of its split prefetched into L2 (64 rows of 1,536 elements,
    24 lines each, over 128 threads: 12 prefetches a thread), then the wait for the kernel before."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import linear_kernels
    fn = linear_kernels.splitk_linear
    sig = dict(x_ptr="*fp16", w_ptr="*fp16", b_ptr="*fp16", out_ptr="*fp16", part_ptr="*fp32", count_ptr="*i32",
               M="i32", stride_xm="i32", stride_wn="i32", stride_om="i32")
    consts = dict(N=1536, K=8960, K_PER=1536, SPLITS=6, BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, HAS_BIAS=True,
                  REDUCE=True, PRECISION="tf32", PDL=pdl, PREFETCH=1536 if pdl else 0)
    hints = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a != "M"}
    compiled = triton.compile(ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                                        constexprs=consts, attrs=hints),
                              target=GPUTarget("cuda", 90, 32), options=dict(linear.LAUNCH))
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and "mma" in ptx and "cp.async" in ptx, "no pipelined tensor-core dot in the PTX"
    assert "atom.global.gpu.acq_rel.add" in ptx, "the count's atomic add is not acquire-release at GPU scope"
    assert "ld.global.cg" in ptx, "the partials are not read from L2"
    assert compiled.metadata.num_warps == linear.LAUNCH["num_warps"]
    assert ptx.count("prefetch.global.L2") == (12 if pdl else 0)
    order = [w for line in ptx.splitlines() for w in ("launch_dependents", "prefetch.global.L2", "griddepcontrol.wait")
             if w in line]
    assert order == (["launch_dependents"] + ["prefetch.global.L2"] * 12 + ["griddepcontrol.wait"] if pdl else []), \
        "with PDL: dependents launched first, the weights prefetched, then the wait, before any other load"
