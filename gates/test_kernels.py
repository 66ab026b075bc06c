"""Kernel gates: every prefill and decode kernel of every attention backend against fp32 attention on a cache rebuilt
from its pages, on a poisoned cache.

The reference gathers each sequence's pages through its block table into contiguous K/V (as vLLM's ref_paged_attn
does) and runs plain attention in fp32. The tolerance is flash-attn's rule: a kernel's max error against the fp32
reference may be at most twice the max error of plain PyTorch attention run in the kernel's dtype (plus a tiny
absolute epsilon, for fp32 where both errors are ~0).

Poison: every slot a sequence does not own, or owns past its length (its last page's tail included), and every page
no sequence owns, holds NaN; only the null page (page 0) is zero. A kernel that loads such a slot at all returns NaN
(`0 * NaN = NaN`), and the gate fails naming the backend, the shape and the error.

Grids: head dims 64 and 128; GQA 12/2, 4/2, 8/8; pages of 64 and 256 slots; histories 1..8192 with the page-boundary
cases (63/64/65, 255/256/257, 4095/4096/4097, ...); block tables in random page order; a cache of thousands of pages
(and, on CUDA, one of more than 2^31 elements) to catch index overflow. Dtypes: fp32 and a few bf16 on CPU, fp16 and
bf16 on CUDA (or just --dtype). Backends: kernels.BACKENDS (or --backend); one that cannot run here skips with its
reason. On CPU the long histories, bf16 FlexAttention and FlexAttention's other shapes (each compiles ~5-25 s on
CPU) are marked slow; `-m slow` runs them.

The grid's kernels are the backends' declared paths (kernels.declared_paths): each decode kernel, with and without
the fused append where the backend has one, and each prefill kernel; every case that passes is recorded for the
coverage gate (gates/coverage.py). Head dims: the Qwen2 family's (64, 128) and the model under test's; a backend
refuses the head dims it was not built for (test_unsupported_shapes_are_refused).

Beside the grid: a cache of thousands of pages; on CUDA a cache tensor over 2^31 elements (gpu marker); and every
decode kernel against the torch one on the same pages.

The checking code lives in gates/kernel_check.py.
"""
from __future__ import annotations

import random

import pytest
import torch

import kernels

from . import coverage
from .kernel_check import (CPU_FLEX_SHAPE, PREFILL_LENS, check_gate_case, check_kernel, compare_decode_kernels,
                           make_case, run_kernel)
# the grid's parameters, the `device` fixture and the skip: pytest takes the hook and the fixture from this module
from .kernel_grid import default_dtype, device, is_cuda, pytest_generate_tests, skip_unless_runs  # noqa: F401

PATHS = {p.name: p for p in kernels.declared_paths()}

# torch.compile (FlexAttention) warns about TorchScript's deprecation from inside torch itself
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


# -- the gates ----------------------------------------------------------------------------------------------------
def test_kernel_gate(path, heads, kv_heads, head_dim, page_size, dtype, lens_name, device):
    """One declared kernel path, one shape, one dtype, on a poisoned cache with shuffled block tables, against the
    fp32 reference. A decode path with the append gets each row's own key and value apart from the cache (their
    slots poisoned) and must write them there as well as attend to them."""
    p = PATHS[path]
    skip_unless_runs(p.backend, device, page_size, dtype, p.kernel if p.op == "decode" else None)
    reason = kernels.backend_class(p.backend).why_unsupported(head_dim, dtype, heads, kv_heads)
    if reason:
        pytest.skip(f"{p.backend} refuses this shape (test_unsupported_shapes_are_refused shows it): {reason}")
    check_gate_case(p, heads, kv_heads, head_dim, page_size, dtype, lens_name, device)
    coverage.checked(p)


REFUSED_HEAD_DIMS = (32, 80, 256)     # head dims no backend that declares its own was built for


def test_unsupported_shapes_are_refused(backend, device):
    """A backend that declares its head dims, dtypes or GQA ratios refuses anything else with Unavailable before a
    kernel launches: an engine over such a model fails at construction, a call at its first layer, never with
    wrong or non-finite attention (or a device-side assert)."""
    cls = kernels.backend_class(backend)
    if cls.head_dims is None:
        pytest.skip(f"{backend} declares no head dims: it runs any")
    refused = [d for d in REFUSED_HEAD_DIMS if d not in cls.head_dims]
    for d in refused:
        reason = cls.why_unsupported(head_dim=d)
        assert reason and f"not {d}" in reason, (backend, d, reason)
    assert cls.why_unsupported(head_dim=cls.head_dims[0]) is None
    dtype = _dtypes_of(cls)[0]
    P = min(cls.page_sizes) if cls.page_sizes else 64
    if kernels.why_unavailable(backend, device, P) is not None:
        return      # where it cannot run, the declaration is what refuses (checked above)
    be = kernels.get_backend(backend, device, P)
    for d in refused:
        case = make_case(device=device, dtype=dtype, num_heads=4, kv_heads=2, head_dim=d, page_size=P,
                         kv_lens=[1, 65], seed=5)
        with pytest.raises(kernels.Unavailable, match=f"not {d}"):
            run_kernel(be, "decode", case, d ** -0.5)


def _dtypes_of(cls) -> list[torch.dtype]:
    return list(cls.dtypes) if cls.dtypes else [torch.float32]


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kernel_large_page_count(backend, kind, device, request):
    """Thousands of pages in the cache, the sequences' pages taken from its top, in random order."""
    dtype = default_dtype(request)
    H, kvh, d = CPU_FLEX_SHAPE if not is_cuda(request.config) else (12, 2, 128)
    sizes = kernels.backend_class(backend).page_sizes
    P = min(sizes) if sizes else 64           # flash runs 256-slot pages only
    skip_unless_runs(backend, device, P, dtype)
    if kind == "decode":
        kv_lens, q_lens = [1, 64, 65, 200, 256, 257, 300, 129, 380], None
    else:
        q_lens, kv_lens = zip(*PREFILL_LENS["edges"])
    num_pages = 3000 if P == 64 else 1000
    check_kernel(backend, kind, device=device, dtype=dtype, num_heads=H, kv_heads=kvh, head_dim=d, page_size=P,
                 kv_lens=kv_lens, q_lens=q_lens, num_pages=num_pages, high_pages=True, seed=7)


# the wide cases' heads: a query group of 32 on one key/value head, wider than the Triton decode's 16-row tile (no
# Qwen2 model has one yet: a padding that assumes the group fits the tile would drop heads)
WIDE_SHAPE = (32, 1, 64)


WIDE_CASES = [
    # more rows than any other case, and than a head dim: short histories, as a wide batch has them at serving time
    # (up to 512 rows on the 1.5B shape); a grid bounded by anything but the rows drops the rows past it
    pytest.param("rows", [1 + (7 * i) % 70 for i in range(200)], id="rows"),
    # more keys in one call than any other case: 24 rows at a 4k context (98k keys, 384 of the Triton decode's
    # items); a grid bounded by anything but the keys the rows hold (the pool's pages, say) drops work
    pytest.param("keys", [4000 + 5 * i for i in range(24)], id="keys"),
    # rows longer than the Triton decode's combine takes in one block of items (ITEM_BLOCK, 32 items of 256 keys:
    # 8,192), up to the 32k context of the Qwen2.5 models, beside one- and two-item rows: 1, 2, 32 (one full block,
    # the table wider than it), 33 (a second block of one item), 65 and 128 items (three and four blocks). Every
    # other case's rows fit one block, where a merge of the blocks (the running max carried over, the previous
    # blocks rescaled, a block's item offset) is never run; the long rows come last, so an offset wrong in a later
    # block reads other rows' items rather than outside the buffer
    pytest.param("items", [1, 300, 8192, 8193, 16385, 32768], id="items"),
]


@pytest.mark.parametrize("what,kv_lens", WIDE_CASES)
def test_kernel_wide(backend, what, kv_lens, device, request):
    """Decode calls wider than the grid's: many rows, many keys, rows of more items than one combine block, a query
    group wider than a tile."""
    dtype = default_dtype(request)
    H, kvh, d = WIDE_SHAPE
    sizes = kernels.backend_class(backend).page_sizes
    P = min(sizes) if sizes else 64
    skip_unless_runs(backend, device, P, dtype)
    check_kernel(backend, "decode", device=device, dtype=dtype, num_heads=H, kv_heads=kvh, head_dim=d, page_size=P,
                 kv_lens=kv_lens, seed=13)


def test_engine_kernel_choices_reach_the_backend(backend, device, runs):
    """Each kernel choice EngineConfig has for a backend (every decode kernel, the fused append off and on where it
    has one) reaches the backend of an engine built with it, and the engine's runner is what Engine.served says it
    serves (gates/dispatch.served_problems). The gates' engine runs serve the defaults, so a build that dropped the
    choices on their way to the backend passed them all: session 17's runner campaign found it (ModelRunner's
    `backend_options or {}` made `and`). Engines are built, not run: no captured steps, no warm-up."""
    from .dispatch import served_problems
    cls = kernels.backend_class(backend)
    P = min(cls.page_sizes) if cls.page_sizes else 64
    skip_unless_runs(backend, device, P)
    built = 0
    for kernel in cls.decode_kernels:
        for append in ((False, True) if cls.appends_decode_kv else (None,)):
            ref = runs.engine_reference("fused", backend, "smoke-cpu", page_size=P, decode_kernel=kernel,
                                        decode_append=append, cuda_graphs=False, compile_warmup=False, poison=False)
            try:
                engine = ref.engine()
            except ValueError:
                continue          # a combination the backend refuses (test_kernel_choices_are_taken_or_refused)
            got = engine.runner.backend
            assert (got.decode_kernel, got.appends_decode_kv) == (kernel, bool(append)), (
                f"EngineConfig(backend={backend!r}, decode_kernel={kernel!r}, decode_append={append}) built a backend "
                f"that runs decode_kernel={got.decode_kernel!r}, decode_append={got.appends_decode_kv}")
            assert served_problems(engine) == []
            built += 1
    assert built >= 1


@pytest.mark.parametrize("forward", ["chunked", "fused"])
def test_each_forward_builds_the_steps_it_serves(backend, device, runs, forward):
    """An engine of each forward over each backend, asking for the captured steps' path (cuda_graphs=True) wherever
    the backend takes it, is built to run what Engine.served says (gates/dispatch.served_problems): its pure decode
    steps captured or not as configured, loaded-step graphs for the fused forward alone. The gates' engine runs build
    the chunked forward over the torch backend only, whose decode takes no captured steps on CUDA: a build that gave
    the chunked forward loaded-step graphs passed them all (session 18's runner campaign). Built, not run."""
    from engine.config import graphs_problem
    from .dispatch import served_problems
    cls = kernels.backend_class(backend)
    P = min(cls.page_sizes) if cls.page_sizes else 64
    skip_unless_runs(backend, device, P)
    ref = runs.engine_reference(forward, backend, "smoke-cpu", page_size=P, cuda_graphs=True, compile_warmup=False)
    why = graphs_problem(ref.config)
    if why:
        pytest.skip(f"{forward}[{backend}]: no captured steps' path here: {why}")
    engine = ref.engine()
    assert engine.runner.graphs is not None, (
        f"{forward}[{backend}] asked for the captured steps' path (cuda_graphs=True, which this backend takes here) "
        "and the runner built no pure decode graphs")
    problems = served_problems(engine)
    assert not problems, f"{forward}[{backend}]: the runner is not what the engine serves: " + "; ".join(problems)


@pytest.mark.parametrize("compile_elementwise", [None, False, True])
def test_engine_builds_the_elementwise_pieces_it_serves(device, runs, compile_elementwise, monkeypatch):
    """An engine compiles the elementwise pieces (norm, rotary, SiLU-mul: engine/layer_kernels.py) where Engine.served says
    they run compiled, and only there: compile_elementwise=True compiles them and warns of no failure, False compiles
    nothing, None is True on CUDA and False elsewhere; the runner's record of its build is that, True or False, and
    its forwards run those pieces (gates/dispatch.served_problems). The gates' engines build their lineage's default
    alone (flash compiled on CUDA; the references and everything on a CPU eager):
    a build that compiled where False is configured, recorded a compile that worked as None, or warned of a failure
    after a compile that worked passed them all (session 19's H200 runner campaign). On a CPU the compile goes
    through Dynamo's eager backend: Inductor's C++ build of the pieces took 25-50 s on two CPU cores, and what is
    checked here is the build's choice, not Inductor's code (on CUDA, Inductor as served). Built, not run."""
    import warnings
    from engine import layer_kernels as M
    from .dispatch import served_problems
    if "torch" not in runs.opts.backends:       # the pieces are the model's, any backend's: built over the reference
        pytest.skip(f"not selected (--backend {','.join(runs.opts.backends)}): built over the torch backend")
    on_cuda = torch.device(device).type == "cuda"
    want = on_cuda if compile_elementwise is None else compile_elementwise
    if not on_cuda:
        monkeypatch.setattr(M, "COMPILE_BACKEND", "eager")
    ref = runs.engine_reference("fused", "torch", "smoke-cpu", compile_elementwise=compile_elementwise,
                                cuda_graphs=False, compile_warmup=False, poison=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ref.engine()
    label = f"EngineConfig(compile_elementwise={compile_elementwise}) on {device}"
    assert engine.served.compile_elementwise is want, (
        f"{label}: Engine.served says compile_elementwise={engine.served.compile_elementwise}, expected {want}")
    failed = [str(w.message) for w in caught if "elementwise pieces failed" in str(w.message)]
    got = getattr(engine.runner, "compiled_elementwise", "no record")
    assert got is want and not failed, (
        f"{label}: the runner records compiled_elementwise={got!r} (expected {want}); warnings of a failed "
        f"compile: {failed or 'none'}")
    # the pieces the runner's forwards are handed (per runner: other engines of this process may compile theirs)
    ops = engine.runner.ops
    eager = sorted(n for n in M.EAGER_OPS if ops[n] is M.EAGER_OPS[n])
    assert eager == ([] if want else sorted(M.EAGER_OPS)), (
        f"{label}: the runner's forwards run {eager or 'none'} of the pieces eagerly; expected "
        f"{'none' if want else 'all'} of {sorted(M.EAGER_OPS)}")
    problems = served_problems(engine)
    assert not problems, f"{label}: the runner is not what the engine serves: " + "; ".join(problems)


SPLIT_KERNELS = {"flash": ("flash",)}   # the one kernel that takes a split count: flash-attn's split-KV decode


def test_kernel_choices_are_taken_or_refused(backend, device):
    """Every kernel choice of EngineConfig (decode_kernel, decode_splits, decode_append) a backend has is taken as
    given, and every one it lacks is refused with a ValueError naming it before anything runs; a call over pages
    of a size the kernels do not take is refused naming the size. What a configuration names is what runs."""
    cls = kernels.backend_class(backend)
    P = min(cls.page_sizes) if cls.page_sizes else 64
    skip_unless_runs(backend, device, P)

    def make(**options):
        return kernels.get_backend(backend, device, P, **options)
    with pytest.raises(ValueError, match="no-such-kernel"):
        make(decode_kernel="no-such-kernel")
    for kernel in cls.decode_kernels:
        assert make(decode_kernel=kernel).decode_kernel == kernel
        if kernel in SPLIT_KERNELS.get(backend, ()):
            for n in (0, 1, 128):           # 0: flash-attn's own heuristic; 128: its limit
                assert make(decode_kernel=kernel, decode_splits=n).decode_splits == n
            for n in (-1, 129):
                with pytest.raises(ValueError, match=f"got {n}"):
                    make(decode_kernel=kernel, decode_splits=n)
        else:
            with pytest.raises(ValueError, match="decode_splits=2"):
                make(decode_kernel=kernel, decode_splits=2)
        if cls.appends_decode_kv:
            assert make(decode_kernel=kernel, decode_append=False).appends_decode_kv is False
            assert make(decode_kernel=kernel, decode_append=True).appends_decode_kv is True
        else:
            with pytest.raises(ValueError, match="decode_append=True"):
                make(decode_kernel=kernel, decode_append=True)
    if cls.page_sizes:
        other = next(n for n in (64, 128, 512) if n not in cls.page_sizes)
        dtype = _dtypes_of(cls)[0]
        case = make_case(device=device, dtype=dtype, num_heads=4, kv_heads=2, head_dim=cls.head_dims[0] if
                         cls.head_dims else 64, page_size=other, kv_lens=[1, 65], seed=5)
        with pytest.raises(kernels.Unavailable, match=f"got {other}"):
            run_kernel(make(), "decode", case, 0.125)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kernel_cache_over_2g_elements(backend, kind, device, request):
    """A cache tensor of more than 2^31 elements, sequences in its last pages: 32-bit slot or element offsets
    overflow here. CUDA only (about 9 GB of fp16 cache)."""
    if torch.device(device).type != "cuda":
        pytest.skip("needs --device cuda: the cache alone is ~9 GB")
    dtype = default_dtype(request)
    H, kvh, d, P = 8, 8, 128, 256
    skip_unless_runs(backend, device, P, dtype)
    per_page = P * kvh * d
    num_pages = (2 ** 31) // per_page + 64
    need = 2 * num_pages * per_page * torch.tensor([], dtype=dtype).element_size()
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if free < need * 1.3:
        pytest.skip(f"needs ~{need * 1.3 / 2**30:.1f} GiB free on the GPU, {free / 2**30:.1f} GiB free")
    if kind == "decode":
        kv_lens, q_lens = [1, 255, 256, 257, 4097, 1000], None
    else:
        q_lens, kv_lens = [1, 256, 100, 512], [300, 256, 4097, 1024]
    check_kernel(backend, kind, device=device, dtype=dtype, num_heads=H, kv_heads=kvh, head_dim=d, page_size=P,
                 kv_lens=kv_lens, q_lens=q_lens, num_pages=num_pages, high_pages=True, seed=11)
    torch.cuda.empty_cache()


def _mixed_histories(n: int, seed: int = 0) -> list[int]:
    """Decode histories as in the mixed workload: a prompt length drawn by MIXED, plus decode progress."""
    from engine.workload import MIXED
    rng = random.Random(seed)
    specs = MIXED.scaled(n).requests()
    return [len(s.prompt) + rng.randrange(1, s.budget + 1) for s in specs]


def test_decode_kernels_agree(backend, device, request):
    """Every available decode kernel and the torch one, on the same poisoned pages (256-slot, shuffled): same output
    within the flash-attn rule's slack. On CUDA: 32 requests with the mixed workload's histories, Qwen2.5-1.5B heads."""
    if backend == "torch":
        pytest.skip("torch is the reference side of this comparison")
    dtype = default_dtype(request)
    P = 256
    skip_unless_runs(backend, device, P, dtype)
    if is_cuda(request.config):
        H, kvh, d = 12, 2, 128
        kv_lens = _mixed_histories(32)
    else:
        H, kvh, d = CPU_FLEX_SHAPE
        kv_lens = [1, 17, 255, 256, 257, 300, 129, 64, 380]
    case = make_case(device=device, dtype=dtype, num_heads=H, kv_heads=kvh, head_dim=d, page_size=P,
                     kv_lens=kv_lens, seed=3)
    compare_decode_kernels([backend], case)




@pytest.mark.parametrize("forward", ["chunked", "fused"])
def test_each_forward_runs_the_steps_it_serves(backend, device, runs, forward):
    """Engines of each forward over each backend serve two requests, the second's prompt beside the first's decode
    tokens (a loaded step): eagerly, the chunked forward runs a loaded step's prompt chunks and its decode batch as
    two forwards and the fused one as one; with the captured steps' path (where the backend takes it), every pure
    decode step runs through the decode graphs. Both run the same tokens either way, within the tie rule, so no token
    gate sees a step run by the other forward, or eagerly beside captured graphs (the runner campaign of session 19
    found both unseen: `forward_mode != "fused"`, `not use_graphs` in ModelRunner.logits)."""
    from engine.config import graphs_problem
    from engine.request import State
    cls = kernels.backend_class(backend)
    P = min(cls.page_sizes) if cls.page_sizes else 64
    skip_unless_runs(backend, device, P)

    def serve(engine) -> list[tuple[bool, bool]]:
        """(prompt chunks?, decode tokens?) of each forward the runner ran."""
        calls, inner = [], engine.runner.forward

        def forward_(chunks, decodes, *args, **kwargs):
            calls.append((bool(chunks), bool(decodes)))
            return inner(chunks, decodes, *args, **kwargs)
        engine.runner.forward = forward_
        first = engine.submit(list(range(7, 7 + P // 2)), 6)
        for _ in range(8):
            if engine.requests[first].state is State.DECODE:
                break
            engine.step()
        engine.submit(list(range(5, 5 + P + 3)), 4)
        engine.run()
        return calls

    eager = runs.engine_reference(forward, backend, "smoke-cpu", page_size=P, cuda_graphs=False,
                                  compile_warmup=False, overlap=False).engine()
    calls = serve(eager)
    loaded = sum(1 for s in eager.trace if s.prompt_positions and s.decode_tokens)
    assert loaded, f"{forward}[{backend}]: the workload made no loaded step: the check checks nothing"
    both = sum(1 for c in calls if c == (True, True))
    if forward == "chunked":
        assert both == 0, (f"{forward}[{backend}]: {both} forward(s) ran prompt chunks and decode tokens together: "
                           f"the chunked forward runs a loaded step as two forwards (the fused forward ran?)")
    else:
        assert both == loaded, (f"{forward}[{backend}]: {loaded} loaded step(s), {both} forward(s) with prompt "
                                f"chunks and decode tokens together: the fused forward runs a loaded step as one "
                                f"(calls {calls})")
    ref = runs.engine_reference(forward, backend, "smoke-cpu", page_size=P, cuda_graphs=True, compile_warmup=False,
                                overlap=False)
    if graphs_problem(ref.config):
        return
    captured = ref.engine()
    serve(captured)
    eager_decode = [r for r in captured.runner.path_census() if r["kind"] == "pure-decode" and r["mode"] == "eager"]
    assert not eager_decode, (f"{forward}[{backend}] with decode graphs: {sum(r['steps'] for r in eager_decode)} "
                              f"pure decode step(s) ran eagerly beside them: {eager_decode}")
