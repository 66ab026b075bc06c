"""kernels/mlp.py, the MLP's gate/up GEMM and SiLU-mul in one Triton kernel: against the fp32 arithmetic at row
counts around its tilings and at shapes that are no multiple of its blocks, a planted off-by-one in the up half
caught by the gate's check, the model running it exactly where a forward's mlp_rows says, and the configuration
that picks it (EngineConfig.mlp_kernel). On CPU the kernel runs in Triton's interpreter, in a child process
(tests/interpreter.py); on CUDA natively, with --device cuda."""
from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig, lineage_config
from engine.errors import ConfigError
from gates.mlp_check import MLP_ROWS, mlp_kernel_problems

triton = pytest.importorskip("triton", reason="the fused MLP kernel needs triton (pip install triton)")

from kernels import mlp  # noqa: E402

from tests.tiny_model import tiny_forwards  # noqa: E402
from tests.interpreter import interpreting, kernel_test_mark, run_kernel_tests_interpreted  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETING = interpreting(triton)
RUNS_HERE = DEVICE == "cuda" or INTERPRETING
kernel_test = kernel_test_mark(triton)
# the interpreter runs fp32 and fp16 (numpy); the GPU bf16 as well
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.skipif(RUNS_HERE, reason="the kernel tests run in this process")
def test_in_the_interpreter():
    """This module's kernel tests, in a child process whose triton interprets (on CPU, numpy for the GPU); not the
    sm_90 compile, which needs the kernel compiled."""
    run_kernel_tests_interpreted(__file__)


@kernel_test
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("hidden,intermediate", [(256, 512), (96, 80), (200, 136)])
def test_the_kernel_matches_the_fp32_arithmetic(hidden, intermediate, dtype):
    """The small model's MLP (256 -> 512) and shapes whose K and N are no multiple of the blocks (masked loads)."""
    rows = MLP_ROWS if hidden == 256 else (1, 17, 32)
    problems = [p for r in rows for p in mlp_kernel_problems(r, hidden, intermediate, dtype, DEVICE)]
    assert not problems, "\n".join(problems)


@kernel_test
@pytest.mark.parametrize("group_m", [1, 3, 16])
def test_every_grid_order_writes_every_block_once(group_m):
    """The grid runs in groups of GROUP_M row blocks (kernels/mlp_kernels.py): 150 rows in 16-row blocks are 10
    row blocks, so groups of 3 leave a last group of one, and 16 is one group of all; 80 columns in 32-column blocks
    end in a partial block. Every output element written (it starts as NaN) and right."""
    problems = mlp_kernel_problems(150, 96, 80, torch.float32, DEVICE, blocks=(16, 32, 32), group_m=group_m)
    assert not problems, "\n".join(problems)


@kernel_test
def test_a_grid_one_program_short_fails_the_check(monkeypatch):
    """A grid whose order skips a block (here: one program short, the last column block of the last row block)
    leaves output unwritten; the check names it as non-finite."""
    from kernels import mlp_kernels
    kernel = mlp_kernels.gate_up_silu

    class Short:
        def __getitem__(self, grid):
            return kernel[(grid[0] - 1,)]
    monkeypatch.setattr(mlp_kernels, "gate_up_silu", Short())
    problems = mlp_kernel_problems(150, 96, 80, torch.float32, DEVICE, blocks=(16, 32, 32), group_m=3)
    assert problems and "group_m 3: non-finite output at [[144, 64]" in problems[0], problems


@kernel_test
def test_an_off_by_one_in_the_up_half_fails_the_check(monkeypatch):
    """The plant `mlp-up-row` (tests/plants.py, which the GPU plant table runs against the kernel gate): the up
    half's rows read one row late, as a kernel whose up offset is off by one would. The gate's check names the
    kernel, the shape and the error."""
    from tests.plants import PLANTS
    PLANTS["mlp-up-row"].patch(monkeypatch)
    problems = mlp_kernel_problems(16, 256, 512, torch.float16, DEVICE)
    assert problems and "the fused MLP kernel (kernels/mlp.py) at 16 rows" in problems[0] \
        and "wrong values" in problems[0], problems


@kernel_test
def test_the_model_runs_the_fused_kernel_exactly_where_mlp_rows_says(monkeypatch):
    """A forward's mlp_rows (ForwardContext: the runner's, from EngineConfig.mlp_kernel) sends an MLP of at most
    that many rows to the kernel, and a larger one to F.linear and the SiLU-mul piece; both give the same logits.
    Built from the small model's shape with random weights (the interpreter: no engine, one forward a case)."""
    calls = []
    fused = mlp.gate_up_silu
    monkeypatch.setattr(mlp, "gate_up_silu", lambda x, w, out=None, **kw: calls.append(x.shape[0]) or fused(x, w, out, **kw))
    took = set()
    out = tiny_forwards(DEVICE, [(rows, mlp_rows, dict(mlp_rows=mlp_rows, mlp_took=took)) for rows in (8, 32, 33)
                                 for mlp_rows in (0, mlp.FUSED_ROWS)])
    assert calls == [8, 8, 32, 32], f"the fused kernel ran at {calls} rows: expected the 8- and 32-row forwards' two "\
        f"layers each (at mlp_rows 32)"
    assert took == {(8, "torch"), (8, "triton"), (32, "torch"), (32, "triton"), (33, "torch")}, \
        f"the forwards recorded {took}"

    for rows in (8, 32, 33):
        diff = (out[rows, 0] - out[rows, mlp.FUSED_ROWS]).abs().max().item()
        assert diff < 1e-3, f"{rows} rows: logits with and without the fused MLP differ by {diff}"


def test_the_configuration_picks_the_kernel_per_device():
    """None: torch's on a CPU (the kernel is for CUDA), named in the served key only where fused; "triton" on a CPU
    and an unknown kernel are refused, naming why."""
    cfg = lineage_config("flash", device="cpu")
    assert cfg.resolved().mlp_kernel == "torch" and "mlp" not in cfg.resolved().key()
    with pytest.raises(ConfigError, match=r"mlp_kernel='triton' on cpu: it is a Triton kernel for CUDA devices"):
        EngineConfig(mlp_kernel="triton")
    with pytest.raises(ConfigError, match=r"mlp_kernel='cutlass': must be one of 'torch', 'triton'"):
        EngineConfig(mlp_kernel="cutlass")
    assert EngineConfig(mlp_kernel="torch").resolved().mlp_kernel == "torch"
    fused = SimpleNamespace(**{**asdict(cfg.resolved()), "mlp_kernel": "triton"})   # as a CUDA device resolves it
    assert EngineConfig.key(fused).endswith("/tp1/mlp-triton")


def test_a_runner_that_runs_the_fused_mlp_unconfigured_fails_the_dispatch_check():
    """gates/dispatch.served_problems (every gate engine's invariant check): a runner whose forwards run the fused
    kernel where the configuration says torch's (or the reverse) is named."""
    from gates.dispatch import served_problems
    from gates.reference import EngineReference
    engine = EngineReference("fused", "small", device="cpu", cuda_graphs=False, progress=False).engine()
    assert not [p for p in served_problems(engine) if "mlp" in p]
    engine.runner.mlp_rows = mlp.FUSED_ROWS
    problems = served_problems(engine)
    assert any("mlp_kernel='torch' is configured, the runner's forwards run the fused MLP kernel up to 32 positions"
               in p for p in problems), problems


def test_the_dispatch_check_holds_the_mlp_kernel_taken_against_the_configured_one():
    """gates/dispatch.layer_dispatch_problems (part of every gate engine run's dispatch check): an MLP of at most 32
    rows that took torch's kernels where the fused one is configured (the plant `mlp-never-fused`, a CUDA one), a
    larger one that took the fused kernel, none recorded though a small forward ran, or the fused kernel taken where
    torch's is configured; a CPU engine's run takes torch's only, and its check is clean."""
    from gates.dispatch import dispatch_problems, layer_dispatch_problems
    from gates.reference import EngineReference

    def engine(kernel, took, steps, forward="fused"):
        trace = [SimpleNamespace(prompt_positions=p, decode_tokens=d) for p, d in steps]
        return SimpleNamespace(runner=SimpleNamespace(mlp_dispatched=set(took)), trace=trace,
                               served=SimpleNamespace(mlp_kernel=kernel, forward=forward))
    small = [(0, 8), (512, 4)]

    def mlp_problems(e):
        return layer_dispatch_problems(e, "mlp_kernel")
    right = {(8, "triton"), (32, "triton"), (33, "torch"), (516, "torch")}
    assert mlp_problems(engine("triton", right, small)) == []
    never = mlp_problems(engine("triton", {(8, "torch"), (516, "torch")}, small))
    assert never == ["dispatch: mlp_kernel='triton' is configured (the fused kernel up to 32 rows), but MLPs of 8 "
                     "rows took torch"], never
    # the threshold off by one either way
    assert mlp_problems(engine("triton", {(32, "torch")}, small))
    assert mlp_problems(engine("triton", {(33, "triton")}, small))
    unrecorded = mlp_problems(engine("triton", {(516, "torch")}, small))
    assert unrecorded == ["dispatch: mlp_kernel='triton' is configured and 1 forward(s) of at most 32 positions "
                          "ran, but no MLP of that size was recorded"], unrecorded
    assert mlp_problems(engine("triton", {(543, "torch")}, [(512, 31)])) == [], "no forward was that small"
    # the chunked forward runs a loaded step's decode rows as a forward of their own: 31 rows is one
    assert mlp_problems(engine("triton", {(512, "torch")}, [(512, 31)], forward="chunked"))
    assert mlp_problems(engine("torch", right, small)) == [
        "dispatch: MLPs of [8, 32] rows ran the fused kernel, but mlp_kernel='torch' is configured"]
    ref = EngineReference("fused", "small", device="cpu", cuda_graphs=False, progress=False)
    e = ref.engine()
    e.submit(list(range(3, 40)), 4, "r0")
    e.run()
    assert {kernel for _, kernel in e.runner.mlp_dispatched} == {"torch"}
    assert not [p for p in dispatch_problems(e) if "MLP" in p]


@pytest.mark.skipif(INTERPRETING, reason="the interpreter's kernels are not compiled")
@pytest.mark.parametrize("rows,blocks,dot,pdl", [(32, None, "mma.sync", False), (544, (64, 64, 64), "wgmma", False),
                                                 (32, None, "mma.sync", True)])
def test_the_gpu_path_compiles_for_sm90_without_a_gpu(rows, blocks, dot, pdl):
    """The kernel as a GPU runs it, compiled through Triton's CUDA backend to PTX for sm_90 (a GPU-only type or
    syntax error fails here, on CPU): at the engine's 32-row tiling its dots are mma.sync; from 64-row blocks (the
    probe's candidates for a loaded step's 544 rows) Hopper's wgmma. With PDL and 512 elements of each gate and up
    row prefetched (kernels/pdl_kernels.py): 2 x 64 rows of 8 lines over 128 threads, 8 prefetches a thread, and
    the wait."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels import mlp_kernels
    bm, bn, bk = blocks or mlp.tiling(rows, 1536)
    sig = dict(x_ptr="*fp16", w_ptr="*fp16", out_ptr="*fp16", M="i32", stride_xm="i32", stride_wn="i32",
               stride_om="i32", N="constexpr", K="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr",
               BLOCK_K="constexpr", GROUP_M="constexpr", PRECISION="constexpr", PDL="constexpr",
               PREFETCH="constexpr")
    consts = dict(N=8960, K=1536, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=mlp.GROUP_M, PRECISION="tf32",
                  PDL=pdl, PREFETCH=512 if pdl else 0)
    compiled = triton.compile(ASTSource(fn=mlp_kernels.gate_up_silu, signature=sig, constexprs=consts),
                              target=GPUTarget("cuda", 90, 32), options=dict(mlp.LAUNCH))
    ptx = compiled.asm["ptx"]
    assert ".target sm_90" in ptx and dot in ptx, f"no {dot} in the PTX at {rows} rows, blocks {(bm, bn, bk)}"
    assert compiled.metadata.num_warps == mlp.LAUNCH["num_warps"]
    assert ptx.count("prefetch.global.L2") == (8 if pdl else 0)
    assert ptx.count("griddepcontrol.") == (2 if pdl else 0)
