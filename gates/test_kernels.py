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

Beside the grid: a cache of thousands of pages; on CUDA a cache tensor over 2^31 elements (gpu marker); flex's
second decode layout (FlexBackend('packed')); and every decode kernel against the torch one on the same pages.

The checking code lives in gates/kernel_check.py.
"""
from __future__ import annotations

import random

import pytest
import torch

import kernels

from .kernel_check import (CPU_FLEX_SHAPE, DECODE_LENS, LONG_SHAPES, PAGE_SIZES, PREFILL_LENS, SHAPES, SHORT,
                           check_kernel, compare_decode_kernels, make_case)
from .options import gate_options

# torch.compile (FlexAttention) warns about TorchScript's deprecation from inside torch itself
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


# -- pytest plumbing ----------------------------------------------------------------------------------------------
def _device(config) -> str:
    return gate_options(config).device


def _is_cuda(config) -> bool:
    return gate_options(config).is_cuda


def _backends(config) -> list[str]:
    return list(gate_options(config).backends)


def _dtypes(config) -> list[torch.dtype]:
    o = gate_options(config)
    if o.dtype_given:
        return [getattr(torch, o.dtype)]
    return [torch.float16, torch.bfloat16] if o.is_cuda else [torch.float32, torch.bfloat16]


def _grid_params(config):
    cuda = _is_cuda(config)
    explicit_dtype = gate_options(config).dtype_given
    out = []
    for name in _backends(config):
        for kind, lens in (("decode", DECODE_LENS), ("prefill", PREFILL_LENS)):
            for lens_name in lens:
                shapes = SHAPES if lens_name != "long" else LONG_SHAPES
                for (H, kvh, d) in shapes:
                    for P in PAGE_SIZES:
                        for dt in _dtypes(config):
                            marks = []
                            if not cuda:
                                slow = lens_name == "long"
                                if dt == torch.bfloat16 and not explicit_dtype:
                                    # a few bf16 cases on CPU: GQA 12/2, head dim 128, torch only
                                    if name != "torch" or (H, kvh, d) != (12, 2, 128) or lens_name == "long":
                                        continue
                                if name == "flex" and ((H, kvh, d) != CPU_FLEX_SHAPE or dt != torch.float32):
                                    slow = True
                                if slow:
                                    marks.append(pytest.mark.slow)
                            out.append(pytest.param(name, kind, H, kvh, d, P, dt, lens_name, marks=marks,
                                                    id=f"{name}-{kind}-h{H}kv{kvh}d{d}-p{P}-{SHORT[dt]}-{lens_name}"))
    return out


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_kernel_gate":
        metafunc.parametrize("backend,kind,heads,kv_heads,head_dim,page_size,dtype,lens_name",
                             _grid_params(metafunc.config))
    elif metafunc.function.__name__ == "test_flex_packed_decode_layout":
        dts = _dtypes(metafunc.config)
        marks = [] if _is_cuda(metafunc.config) else [pytest.mark.slow]
        metafunc.parametrize("dtype", [pytest.param(dt, marks=marks, id=SHORT[dt]) for dt in dts])
    elif "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", _backends(metafunc.config))


@pytest.fixture
def device(request) -> str:
    return _device(request.config)


def skip_unless_runs(name: str, device, page_size: int, dtype: torch.dtype | None = None) -> None:
    """Skip, with the backend's own reason, where it cannot run; never silently."""
    cls = kernels.backend_class(name)
    reason = cls.why_unavailable(torch.device(device), page_size)
    if reason is None and dtype is not None:
        reason = cls.why_unsupported(dtype=dtype)
    if reason:
        pytest.skip(f"{name}: {reason}")


def _default_dtype(request) -> torch.dtype:
    return _dtypes(request.config)[0]


# -- the gates ----------------------------------------------------------------------------------------------------
def test_kernel_gate(backend, kind, heads, kv_heads, head_dim, page_size, dtype, lens_name, device):
    """One kernel, one shape, one dtype, on a poisoned cache with shuffled block tables, against the fp32 reference."""
    skip_unless_runs(backend, device, page_size, dtype)
    if kind == "decode":
        kv_lens, q_lens = DECODE_LENS[lens_name], None
    else:
        q_lens, kv_lens = zip(*PREFILL_LENS[lens_name])
    check_kernel(backend, kind, device=device, dtype=dtype, num_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                 page_size=page_size, kv_lens=kv_lens, q_lens=q_lens, seed=heads * 1000 + head_dim + page_size)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kernel_large_page_count(backend, kind, device, request):
    """Thousands of pages in the cache, the sequences' pages taken from its top, in random order."""
    dtype = _default_dtype(request)
    H, kvh, d = CPU_FLEX_SHAPE if not _is_cuda(request.config) else (12, 2, 128)
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


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_kernel_cache_over_2g_elements(backend, kind, device, request):
    """A cache tensor of more than 2^31 elements, sequences in its last pages: 32-bit slot or element offsets
    overflow here. CUDA only (about 9 GB of fp16 cache)."""
    if torch.device(device).type != "cuda":
        pytest.skip("needs --device cuda: the cache alone is ~9 GB")
    dtype = _default_dtype(request)
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
    dtype = _default_dtype(request)
    P = 256
    skip_unless_runs(backend, device, P, dtype)
    if _is_cuda(request.config):
        H, kvh, d = 12, 2, 128
        kv_lens = _mixed_histories(32)
    else:
        H, kvh, d = CPU_FLEX_SHAPE
        kv_lens = [1, 17, 255, 256, 257, 300, 129, 64, 380]
    case = make_case(device=device, dtype=dtype, num_heads=H, kv_heads=kvh, head_dim=d, page_size=P,
                     kv_lens=kv_lens, seed=3)
    compare_decode_kernels([backend], case)


@pytest.mark.parametrize("kind_lens", ["edges", "long"])
def test_flex_packed_decode_layout(dtype, kind_lens, device, request):
    """flex's other decode layout (the rows as queries of one call over packed histories, FlexBackend('packed'))
    under the same gate."""
    from kernels.flex_backend import FlexBackend
    if not _is_cuda(request.config) and kind_lens == "long":
        pytest.skip("long histories of the packed decode layout run on CUDA only (CPU compile time)")
    skip_unless_runs("flex", device, 64, dtype)
    H, kvh, d = CPU_FLEX_SHAPE if not _is_cuda(request.config) else (12, 2, 128)
    check_kernel(FlexBackend("packed"), "decode", device=device, dtype=dtype, num_heads=H, kv_heads=kvh, head_dim=d,
                 page_size=64, kv_lens=DECODE_LENS[kind_lens], seed=13)
