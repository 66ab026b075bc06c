"""The kernel gates' grid (gates/test_kernels.py) as pytest parameters: one case per declared kernel path, shape, page
size, dtype and history set on the run's device, the backends and dtypes its other gates take, and the skip that
names why a backend cannot run here."""
from __future__ import annotations

import pytest
import torch

import kernels

from .kernel_check import CPU_FLEX_SHAPE, DECODE_LENS, LONG_SHAPES, PAGE_SIZES, PREFILL_LENS, SHAPES, SHORT
from .options import gate_options


def run_device(config) -> str:
    return gate_options(config).device


def is_cuda(config) -> bool:
    return gate_options(config).is_cuda


def backends(config) -> list[str]:
    return list(gate_options(config).backends)


def dtypes(config) -> list[torch.dtype]:
    o = gate_options(config)
    if o.dtype_given:
        return [getattr(torch, o.dtype)]
    return [torch.float16, torch.bfloat16] if o.is_cuda else [torch.float32, torch.bfloat16]


def head_dims(config) -> list[tuple[int, int, int]]:
    """The grid's (heads, kv heads, head dim) shapes: SHAPES (the Qwen2 family's head dims, 64 and 128), and the
    model under test's own where --model brings another."""
    o = gate_options(config)
    try:
        from engine.loader import model_config
        c = model_config(o.model_arg)
    except (OSError, ValueError, KeyError):   # a model the loader cannot read fails its engine gates, with the reason
        return list(SHAPES)
    heads = c["num_attention_heads"]
    own = (heads, c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads)
    return list(SHAPES) + ([own] if own not in SHAPES else [])


def grid_params(config):
    """One case per declared kernel path (kernels.declared_paths: the registry, so that a new path is gated by
    construction), shape, page size, dtype and history set."""
    cuda = is_cuda(config)
    explicit_dtype = gate_options(config).dtype_given
    out = []
    # the paths the device serves by default first (flash on CUDA: its decode with the append is the pure decode
    # step), so that a bug there fails within seconds of the kernel gate's start
    served = "flash" if cuda else "torch"
    for path in sorted(kernels.declared_paths(backends(config)), key=lambda p: p.backend != served):
        name, kind = path.backend, path.op
        lens = DECODE_LENS if kind == "decode" else PREFILL_LENS
        for lens_name in lens:
            shapes = head_dims(config) if lens_name != "long" else LONG_SHAPES
            for (H, kvh, d) in shapes:
                for P in PAGE_SIZES:
                    for dt in dtypes(config):
                        marks = []
                        if not cuda:
                            slow = lens_name == "long"
                            if dt == torch.bfloat16 and not explicit_dtype:
                                # a few bf16 cases on CPU: GQA 12/2, head dim 128, torch only
                                if name != "torch" or (H, kvh, d) != (12, 2, 128) or lens_name == "long":
                                    continue
                            if name == "flex" and ((H, kvh, d) != CPU_FLEX_SHAPE or dt != torch.float32 or
                                                   (path.kernel == "packed" and kind == "decode" and P != 64)):
                                slow = True
                            if slow:
                                marks.append(pytest.mark.slow)
                        out.append(pytest.param(path.name, H, kvh, d, P, dt, lens_name, marks=marks,
                                                id=f"{path.name}-h{H}kv{kvh}d{d}-p{P}-{SHORT[dt]}-{lens_name}"))
    return out


def model_shapes(config) -> list[tuple[int, int, int, int, int]]:
    """(hidden, intermediate, heads, kv heads, head dim) of the model under test and of the 1.5B shape: the layer
    kernels' gates run both."""
    from engine.loader import QWEN25_1P5B, model_config

    def shape(c):
        heads = c["num_attention_heads"]
        return (c["hidden_size"], c["intermediate_size"], heads, c.get("num_key_value_heads") or heads,
                c.get("head_dim") or c["hidden_size"] // heads)
    out = [shape(QWEN25_1P5B)]
    try:
        own = shape(model_config(gate_options(config).model_arg))
    except (OSError, ValueError, KeyError):   # a model the loader cannot read fails its engine gates, with the reason
        return out
    return ([own] if own not in out else []) + out


def mlp_shapes(config) -> list[tuple[int, int]]:
    """The fused MLP kernel's (hidden, intermediate) shapes: the model under test's and the 1.5B shape's."""
    return list(dict.fromkeys(s[:2] for s in model_shapes(config)))


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ == "test_mlp_kernel_gate":
        cases = [pytest.param(h, n, dt, id=f"mlp-{h}x{n}-{SHORT[dt]}") for h, n in mlp_shapes(metafunc.config)
                 for dt in dtypes(metafunc.config)]
        metafunc.parametrize("hidden,intermediate,dtype", cases)
    elif metafunc.function.__name__ == "test_linear_kernel_gate":
        cases = [pytest.param(s, dt, id=f"linear-{s[0]}x{s[1]}-h{s[2]}kv{s[3]}d{s[4]}-{SHORT[dt]}")
                 for s in model_shapes(metafunc.config) for dt in dtypes(metafunc.config)]
        metafunc.parametrize("shape,dtype", cases)
    elif metafunc.function.__name__ == "test_kernel_gate":
        metafunc.parametrize("path,heads,kv_heads,head_dim,page_size,dtype,lens_name",
                             grid_params(metafunc.config))
    elif "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", backends(metafunc.config))


@pytest.fixture
def device(request) -> str:
    return run_device(request.config)


def skip_unless_runs(name: str, device, page_size: int, dtype: torch.dtype | None = None,
                     decode_kernel: str | None = None) -> None:
    """Skip, with the backend's own reason, where it cannot run; never silently."""
    cls = kernels.backend_class(name)
    reason = cls.why_unavailable(torch.device(device), page_size, decode_kernel)
    if reason is None and dtype is not None:
        reason = cls.why_unsupported(dtype=dtype)
    if reason:
        pytest.skip(f"{name}: {reason}")


def default_dtype(request) -> torch.dtype:
    return dtypes(request.config)[0]
