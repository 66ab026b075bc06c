"""The layers' kernels besides attention, chosen per runner: the elementwise pieces (norm, rotary, SiLU-mul: eager, or
torch.compile'd where EngineConfig.compile_elementwise says so, handed to every forward as ForwardContext.ops) and the
warm-ups of the Triton MLP and projection kernels (kernels/mlp.py, kernels/linear.py) that a runner runs before any
step or capture. engine/model.py's layers call them; engine/runner.py's build_runner picks and warms them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .model import Qwen2


# -- elementwise pieces ----------------------------------------------------------------------------------------
# A decode step of a 28-layer model at 32 rows is mostly small kernels: each costs a few microseconds even inside a
# CUDA graph. These run as several kernels each in eager mode; compiled_ops() gives torch.compile'd versions (one
# fused kernel each), which a runner whose configuration compiles them (EngineConfig.compile_elementwise) hands its
# forwards. Same arithmetic either way: fp32 normalisation as transformers does it.
def rms_norm(x, weight, eps: float):
    # as transformers does it: normalise in fp32, then scale in the model's dtype
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(x, residual, weight, eps: float):
    """(rms_norm(x + residual), x + residual): the residual add fused into the norm that follows it (one kernel
    compiled instead of two); the sum is taken in the model's dtype, as transformers' layer does."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(x, cos, sin):
    """x: [T, heads, d] (query and key heads together); cos, sin: [T, d]."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def rope_write(qkv, cos, sin, k_slots, v_slots, slots):
    """The queries rotated, returned; the keys rotated and the values written to their cache slots (`k_slots`,
    `v_slots`: the caches as [slots, kv_heads, d]; `slots`: [T], each packed position's slot). Compiled, one kernel
    where rope and the two cache writes were three a layer (a loaded step at chunk 512 on the 1.5B shape: 56
    index_put kernels of about 5 us each on the H200). Inductor writes the caches in place (their index_put is
    reinplaced: tests/test_elementwise.py checks that no cache is copied). The caches come flat, so one kernel
    serves every page size and pool size (the slot count is its only dynamic size besides the tokens); the head
    counts come from the shapes, which are static: no int argument becomes symbolic."""
    kvh = k_slots.shape[1]
    nq = qkv.shape[1] - 2 * kvh
    qk = rope(qkv[:, :nq + kvh], cos, sin)
    k_slots[slots] = qk[:, nq:]
    v_slots[slots] = qkv[:, nq + kvh:]
    return qk[:, :nq]


def silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


EAGER_OPS = {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "rope": rope, "rope_write": rope_write,
             "silu_mul": silu_mul}

# torch.compile's backend for the pieces (the tests swap in one that records Dynamo's graphs on CPU)
COMPILE_BACKEND = "inductor"
_COMPILED: dict = {}        # compile backend -> its table of compiled pieces, one per process


def compiled_ops() -> dict:
    """The torch.compile'd pieces, one table a process (per compile backend): every runner that compiles them shares
    it, so Dynamo's caches serve them all and a later engine's warm-up finds its kernels compiled. Per runner, not
    process-wide: an eager engine (the reference configurations) and a compiled one (flash) gate in one process, each
    running its own (ForwardContext.ops).

    The token dimension is dynamic, the hidden sizes are not. With dynamic=True they were symbolic too, so every
    index of the generated kernels divided by a runtime value: on the H200 at 8192 tokens of the 1.5B shape each
    piece ran at 400-1800 GB/s, and at 900-4300 GB/s with constant sizes (SiLU-mul 293 -> 102 us a call;
    scripts/probes/elementwise.py, docs/RESULTS.md). dynamic=None (automatic): a piece is compiled for the
    shapes it sees, and a size that changes between calls becomes dynamic. The warm-up marks the token dimension
    dynamic at once; a guard the warm-up did not match (grad mode, a weight's flags) costs a recompile, never a
    kernel per token count."""
    key = COMPILE_BACKEND if isinstance(COMPILE_BACKEND, str) else id(COMPILE_BACKEND)
    if key not in _COMPILED:
        _COMPILED[key] = {name: torch.compile(fn, dynamic=None, fullgraph=True, backend=COMPILE_BACKEND)
                          for name, fn in EAGER_OPS.items()}
    return _COMPILED[key]


def reset_compiled_ops() -> None:
    """Forget the compiled tables (after torch._dynamo.reset(), or a test's own compile backend)."""
    _COMPILED.clear()


def _tokens_dynamic(*tensors):
    """The token dimension dynamic (maybe_: a size-1 one is specialised rather than refused), every other one
    static. Static explicitly: Dynamo's automatic dynamic shapes make a size symbolic once it changed between two
    compiles of a function, in this process (a second model of other widths) or in an earlier one whose profile the
    compile cache folder keeps ("local PGO")."""
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
        for d in range(1, t.dim()):
            torch._dynamo.mark_static(t, d)
    return tensors


def try_compile_elementwise(device, dtype, model: "Qwen2", tokens: int = 64,
                            rotary: bool = True, names=None) -> tuple[dict, str | None]:
    """compiled_ops(), then calls of each piece on `device` as the model's forward makes them (inference
    mode, the model's norm weight, the rotary input a slice of the fused qkv output), so that every kernel a step
    needs is compiled here, none in a step or a CUDA graph capture; and a compiler that cannot run here falls back
    to eager at once (returns why) instead of failing a step later. Token counts 1 and `tokens` (the most a step
    carries): Dynamo specialises 1; the other marks the token dimension dynamic, so every later count reuses that
    kernel, and Inductor picks its launch configuration from that call's sizes. From 2 tokens, as before 2026-12-01
    (s7), the SiLU-mul kernel it chose ran at a quarter of the bandwidth at 640 tokens on the H200 (28 us a call
    against 6: docs/RESULTS.md). rope_write's caches: any slot count (made outside inference mode, as the runner's
    are). `rotary`: compile the rotary piece alone too (only a pure decode step whose kernel appends K/V without
    rotating calls it). `names`: only these pieces (None: all; the gate prewarm compiles one a process into the
    shared compile cache, gates/prewarm.py; the table returned compiles the others at their first call). Returns
    (the pieces to run, None), or (EAGER_OPS, why the compile failed)."""
    s = model.shape
    compiled = compiled_ops()
    wanted = set(EAGER_OPS if names is None else names)
    # a piece not wanted runs eagerly here (its compile is left to whoever wants it)
    ops = {name: fn if name in wanted else EAGER_OPS[name] for name, fn in compiled.items()}
    w = getattr(model, "shard", model).model.norm.weight     # a tensor-parallel rank's model wraps its shard
    caches = _tokens_dynamic(*(torch.zeros(2 * max(2, tokens), s.num_kv_heads, s.head_dim, device=device,
                                           dtype=dtype) for _ in "kv"))         # the slot count: any
    try:
        with torch.inference_mode():
            for T in (1, max(2, tokens)):
                x, r = _tokens_dynamic(*(torch.randn(T, s.hidden_size, device=device, dtype=dtype) for _ in "xr"))
                ops["rms_norm"](x, w, s.rms_norm_eps)
                ops["add_rms_norm"](x, r, w, s.rms_norm_eps)
                qkv = torch.randn(T, s.num_heads + 2 * s.num_kv_heads, s.head_dim, device=device, dtype=dtype)
                qk, cos, sin = _tokens_dynamic(qkv[:, :s.num_heads + s.num_kv_heads],
                                               *(torch.randn(T, s.head_dim, device=device, dtype=dtype) for _ in "cs"))
                if rotary:
                    ops["rope"](qk, cos, sin)
                slots, = _tokens_dynamic(torch.arange(T, device=device))
                ops["rope_write"](*_tokens_dynamic(qkv), cos, sin, *caches, slots)
                gate_up = torch.randn(T, 2 * s.intermediate_size, device=device, dtype=dtype)
                ops["silu_mul"](*_tokens_dynamic(gate_up))
    except Exception as e:  # noqa: BLE001 (any compiler failure means: run eagerly)
        return EAGER_OPS, f"{type(e).__name__}: {e}"
    return compiled, None


@torch.inference_mode()
def warm_mlp(model, device, dtype, pdl: bool = False) -> None:
    """The fused MLP kernel at each of its row tilings (kernels/mlp.py), over the first layer's weights."""
    from kernels.mlp import FUSED_ROWS, gate_up_silu
    mlp = getattr(model, "shard", model).model.layers[0].mlp      # a tensor-parallel rank's model wraps its shard
    from kernels.pdl import MLP_PREFETCH
    for rows in (1, FUSED_ROWS):
        gate_up_silu(torch.zeros(rows, model.shape.hidden_size, device=device, dtype=dtype), mlp.gate_up_weight,
                     pdl=pdl, prefetch=MLP_PREFETCH)


@torch.inference_mode()
def warm_linear(model, device, dtype, pdl: bool = False) -> None:
    """The split-K linear kernel (kernels/linear.py) at each of its row tilings over the first layer's q/k/v, o and
    down: compiled, and its workspace made at its largest, before any CUDA graph captures a call (a capture cannot
    grow it)."""
    from kernels.linear import SKINNY_ROWS, splitk_linear
    from kernels.pdl import LINEAR_PREFETCH
    layer = getattr(model, "shard", model).model.layers[0]
    attn, down = layer.self_attn, layer.mlp.down_proj
    for rows in (1, SKINNY_ROWS):
        for w, b in ((attn.qkv_weight, attn.qkv_bias), (attn.o_proj.weight, None), (down.weight, None)):
            splitk_linear(torch.zeros(rows, w.shape[1], device=device, dtype=dtype), w, b, pdl=pdl,
                          prefetch=LINEAR_PREFETCH)
