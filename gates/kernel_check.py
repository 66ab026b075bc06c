"""The kernel check: a paged case on a poisoned cache, the fp32 reference attention, and `check_kernel`, which fails
naming the backend, the kernel, the shape and the error (gates/test_kernels.py; tests/test_planted_kernels.py).

The reference gathers each sequence's pages through its block table into contiguous K/V (as vLLM's ref_paged_attn
does) and runs plain attention in fp32. The tolerance is flash-attn's rule: a kernel's max error against the fp32
reference may be at most twice the max error of plain PyTorch attention run in the kernel's dtype (plus a tiny
absolute epsilon, for fp32 where both errors are ~0).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

import kernels
from kernels import AttnBatch
from kernels.base import AttentionBackend

from .failure import GateFailure

SHORT = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
EPS = 1e-5          # absolute slack on top of 2x the plain-attention error (flash-attn's tests use the same)

# -- the grids ---------------------------------------------------------------------------------------------------
SHAPES = [(12, 2, 128), (12, 2, 64), (4, 2, 128), (4, 2, 64), (8, 8, 128), (8, 8, 64)]   # heads, kv heads, dim
LONG_SHAPES = [(12, 2, 128), (4, 2, 64)]
PAGE_SIZES = [64, 256]
DECODE_LENS = {
    # one decode row per request; histories around page edges (max 300: flex pads it to 512)
    "edges": [1, 2, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300],
    "long": [1, 255, 256, 257, 1000, 4095, 4096, 4097, 8191, 8192],
}
PREFILL_LENS = {
    # (chunk length, history length including the chunk): fresh prompts, chunks after history, page edges
    "edges": [(1, 1), (5, 5), (64, 64), (65, 65), (1, 256), (7, 257), (64, 320), (128, 255), (33, 513), (2, 2)],
    "long": [(512, 4096), (512, 8192), (300, 1000), (1, 8192), (256, 256)],
}
CPU_FLEX_SHAPE = (4, 2, 64)      # the one FlexAttention shape compiled in the default CPU run
ROPE_THETA = 1e6                 # Qwen2's rotary base: a kernel that rotates (rotates_decode) is checked with it


# -- the paged case ---------------------------------------------------------------------------------------------
@dataclass
class PagedCase:
    k_cache: torch.Tensor            # [num_pages, page_size, kv_heads, head_dim], poisoned
    v_cache: torch.Tensor
    tables: list[list[int]]          # each sequence's pages, in (shuffled) order
    kv_lens: list[int]
    q_lens: list[int]
    q: torch.Tensor                  # [sum(q_lens), heads, head_dim]
    page_size: int

    def batch(self) -> AttnBatch:
        """The AttnBatch the runner would build: block tables padded with the null page, int32 device tensors."""
        dev = self.k_cache.device
        width = max(len(t) for t in self.tables)
        bt = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32, device=dev)
        cu = [0]
        for n in self.q_lens:
            cu.append(cu[-1] + n)
        return AttnBatch(list(self.q_lens), list(self.kv_lens), bt,
                         torch.tensor(self.kv_lens, dtype=torch.int32, device=dev),
                         torch.tensor(cu, dtype=torch.int32, device=dev), self.page_size)


def make_case(*, device, dtype, num_heads, kv_heads, head_dim, page_size, kv_lens, q_lens=None, seed=0,
              num_pages=None, high_pages=False, poison=True) -> PagedCase:
    """A poisoned paged cache holding `kv_lens` histories in shuffled pages, and the queries.

    num_pages: pages in the cache (default: twice what the sequences need, plus 8, all the rest poisoned);
    high_pages: take the sequences' pages from the top of a large cache (index overflow)."""
    device = torch.device(device)
    q_lens = list(q_lens) if q_lens is not None else [1] * len(kv_lens)
    if len(q_lens) != len(kv_lens) or not all(0 < q <= k for q, k in zip(q_lens, kv_lens)):
        raise ValueError(f"q_lens {q_lens} and kv_lens {kv_lens}: one query length per history, 0 < q <= kv")
    P = page_size
    need = [-(-k // P) for k in kv_lens]
    total = sum(need)
    N = num_pages or (1 + 2 * total + 8)
    if N <= total:
        raise ValueError(f"num_pages {N} cannot hold the {total} pages the histories need, plus the null page")
    rng = random.Random(seed)
    pool = list(range(max(1, N - 2 * total - 1), N)) if high_pages else list(range(1, N))
    pages = rng.sample(pool, total)                 # random order: block tables are shuffled
    tables, i = [], 0
    for n in need:
        tables.append(pages[i:i + n])
        i += n
    fill = float("nan") if poison else 0.0
    kc = torch.full((N, P, kv_heads, head_dim), fill, dtype=dtype, device=device)
    vc = torch.full_like(kc, fill)
    kc[0] = 0
    vc[0] = 0
    # drawn where the case lives: on a GPU, drawing on the host and copying took 5 s of the serial GPU gate suite
    # (session 41's profile); the same seed gives the same case on one kind of device
    g = torch.Generator(device=device).manual_seed(seed)
    slots = torch.cat([torch.tensor(t).repeat_interleave(P)[:k] * P + torch.arange(k) % P
                       for t, k in zip(tables, kv_lens)]).to(device)
    n = int(slots.numel())
    kc.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=g, device=device).to(dtype)
    vc.view(-1, kv_heads, head_dim)[slots] = torch.randn(n, kv_heads, head_dim, generator=g, device=device).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g, device=device).to(dtype)
    return PagedCase(kc, vc, tables, list(kv_lens), q_lens, q, P)


def reference_attention(case: PagedCase, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Attention on a cache rebuilt from the pages: per sequence, its pages gathered through its block table into
    contiguous K/V cut at its length, queries at the last q_len positions, causal. dtype float32: the reference;
    the kernel's dtype: plain PyTorch attention in that dtype (scores and P @ V in it, softmax in fp32)."""
    kvh, d = case.k_cache.shape[2], case.k_cache.shape[3]
    H = case.q.shape[1]
    g = H // kvh
    outs, row = [], 0
    dev = case.k_cache.device
    for pages, kv, ql in zip(case.tables, case.kv_lens, case.q_lens):
        idx = torch.tensor(pages, device=dev)
        k = case.k_cache[idx].reshape(-1, kvh, d)[:kv].to(dtype).repeat_interleave(g, dim=1)   # [kv, H, d]
        v = case.v_cache[idx].reshape(-1, kvh, d)[:kv].to(dtype).repeat_interleave(g, dim=1)
        q = case.q[row:row + ql].to(dtype)                                                     # [ql, H, d]
        row += ql
        s = torch.matmul(q.transpose(0, 1), k.permute(1, 2, 0)) * scale                        # [H, ql, kv]
        qpos = kv - ql + torch.arange(ql, device=dev)
        mask = torch.arange(kv, device=dev)[None, :] <= qpos[:, None]
        s = s.masked_fill(~mask, float("-inf"))
        p = torch.softmax(s.float(), dim=-1).to(dtype)
        outs.append(torch.matmul(p, v.transpose(0, 1)).transpose(0, 1))                       # [ql, H, d]
    return torch.cat(outs)


def _as_backend(backend, device, page_size) -> AttentionBackend:
    if isinstance(backend, AttentionBackend):
        return backend
    if isinstance(backend, type):
        reason = backend.why_unavailable(torch.device(device), page_size)
        if reason:
            raise kernels.Unavailable(f"attention backend {backend.name!r} cannot run here: {reason}")
        return backend()
    return kernels.get_backend(backend, device, page_size)


def _lens_str(xs, limit=12) -> str:
    s = ",".join(map(str, xs[:limit]))
    return f"[{s}{',...' if len(xs) > limit else ''}] ({len(xs)} seqs)"


def run_kernel(backend: AttentionBackend, kind: str, case: PagedCase, scale: float,
               new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    batch = case.batch()
    with torch.inference_mode():
        backend.prepare(batch, kind)
        if kind == "decode":
            return backend.decode(case.q, case.k_cache, case.v_cache, batch, scale,
                                  **({"new_kv": new_kv} if new_kv is not None else {}),
                                  **({"rope": rope} if rope is not None else {}))
        return backend.prefill(case.q, case.k_cache, case.v_cache, batch, scale)


def last_slots(case: PagedCase) -> torch.Tensor:
    """Each sequence's last cache slot (page * page_size + offset): where a decode row's own key goes."""
    P = case.page_size
    return torch.tensor([t[(k - 1) // P] * P + (k - 1) % P for t, k in zip(case.tables, case.kv_lens)],
                        device=case.k_cache.device)


def rotary_case(case: PagedCase):
    """For a decode kernel that appends and rotates (rotates_decode), as the model calls it: the case's queries and
    its rows' last keys are taken as unrotated, with cos and sin at each row's new position (its last one). Returns
    (the case the reference attends: queries and last keys rotated as the model's rope does it, in fp32 rounded
    once; (cos, sin) for the kernel; the rotation)."""
    from engine.layer_kernels import rope
    from engine.model import Rotary
    kvh, d = case.k_cache.shape[2], case.k_cache.shape[3]
    dtype, dev = case.k_cache.dtype, case.k_cache.device
    pos = torch.tensor([n - 1 for n in case.kv_lens], device=dev)
    cos, sin = Rotary(d, ROPE_THETA).to(dev)(pos, dtype)

    def rot(x: torch.Tensor) -> torch.Tensor:
        return rope(x.float(), cos.float(), sin.float()).to(dtype)

    k = case.k_cache.clone()
    flat, slots = k.view(-1, kvh, d), last_slots(case)
    flat[slots] = rot(flat[slots])
    return replace(case, q=rot(case.q), k_cache=k), (cos, sin), rot


def take_appended(case: PagedCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' own keys and values taken out of the cache, their slots poisoned: what a step hands a decode
    kernel that appends (the kernel must write them there, and attend to them)."""
    kvh, d = case.k_cache.shape[2], case.k_cache.shape[3]
    slots = last_slots(case)
    out = []
    for cache in (case.k_cache, case.v_cache):
        flat = cache.view(-1, kvh, d)
        out.append(flat[slots].clone())
        flat[slots] = float("nan")
    return out[0], out[1]


def describe(name, kind, case: PagedCase, dtype) -> str:
    H, d = case.q.shape[1], case.q.shape[2]
    kvh, N = case.k_cache.shape[2], case.k_cache.shape[0]
    s = (f"backend {name!r} {kind} kernel, heads {H}/{kvh} (GQA {H // kvh}), head_dim {d}, page_size "
         f"{case.page_size}, {N} pages, {SHORT.get(dtype, dtype)}, kv_lens {_lens_str(case.kv_lens)}")
    if kind == "prefill":
        s += f", q_lens {_lens_str(case.q_lens)}"
    return s


def locate(case: PagedCase, err: torch.Tensor) -> str:
    """Where the worst (or first non-finite) output is: sequence, its lengths, query row, head."""
    e = torch.nan_to_num(err.float(), nan=float("inf")).amax(-1)          # [rows, heads]
    flat = int(e.flatten().argmax())
    row, head = divmod(flat, e.shape[1])
    start = 0
    for b, ql in enumerate(case.q_lens):
        if row < start + ql:
            return (f"sequence {b} (kv_len {case.kv_lens[b]}, q_len {ql}, pages {case.tables[b][:8]}"
                    f"{'...' if len(case.tables[b]) > 8 else ''}), query row {row - start}, head {head}")
        start += ql
    return f"row {row}, head {head}"


def check_gate_case(path, heads: int, kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
                    lens_name: str, device) -> dict:
    """One case of the kernel gate's grid (gates/test_kernels.py): `path` (a kernels.declared_paths() entry) on
    that shape, page size, dtype and history set, its backend built with the path's options. The gate and the
    compile prewarm (gates/prewarm.py) both run this."""
    if path.op == "decode":
        kv_lens, q_lens = DECODE_LENS[lens_name], None
    else:
        q_lens, kv_lens = zip(*PREFILL_LENS[lens_name])
    backend = kernels.get_backend(path.backend, device, page_size, **path.options())
    return check_kernel(backend, path.op, device=device, dtype=dtype, num_heads=heads, kv_heads=kv_heads,
                        head_dim=head_dim, page_size=page_size, kv_lens=kv_lens, q_lens=q_lens,
                        seed=heads * 1000 + head_dim + page_size, append=path.append)


def check_kernel(backend, kind: str, *, device="cpu", dtype=torch.float32, num_heads=4, kv_heads=2, head_dim=64,
                 page_size=64, kv_lens=(1, 65, 257), q_lens=None, seed=0, num_pages=None, high_pages=False,
                 poison=True, case: PagedCase | None = None, append: bool = False) -> dict:
    """The kernel gate: run `backend`'s `kind` kernel ('prefill' or 'decode') on a poisoned paged cache and hold
    it to flash-attn's rule against fp32 attention on the cache rebuilt from its pages. Raises GateFailure
    naming the backend, the kernel, the shape and the error; returns {'err', 'base', 'tol'} when it passes.

    backend: a name in kernels.BACKENDS, a backend class, or an instance (planted bugs pass instances)."""
    if kind not in ("prefill", "decode"):
        raise ValueError(f"kind {kind!r}: 'prefill' or 'decode'")
    if case is None:
        if kind == "decode":
            q_lens = None
        case = make_case(device=device, dtype=dtype, num_heads=num_heads, kv_heads=kv_heads, head_dim=head_dim,
                         page_size=page_size, kv_lens=list(kv_lens), q_lens=q_lens, seed=seed, num_pages=num_pages,
                         high_pages=high_pages, poison=poison)
    dtype = case.k_cache.dtype
    be = _as_backend(backend, case.k_cache.device, case.page_size)
    name = getattr(be, "name", type(be).__name__)
    scale = case.q.shape[2] ** -0.5
    what = describe(name, kind, case, dtype) + (", the rows' own keys appended by the kernel" if append else "")
    ref_case, rope, rot = case, None, None
    if append and getattr(be, "rotates_decode", False):
        ref_case, rope, rot = rotary_case(case)
        what += ", queries and keys unrotated with cos and sin (the kernel rotates them)"
    ref = reference_attention(ref_case, scale, torch.float32)
    base = 0.0 if dtype == torch.float32 else float(
        (reference_attention(ref_case, scale, dtype).float() - ref).abs().max())
    new_kv = take_appended(case) if append else None
    out = run_kernel(be, kind, case, scale, new_kv, rope)
    if tuple(out.shape) != tuple(case.q.shape):
        raise GateFailure(f"{what}: output shape {tuple(out.shape)}, expected {tuple(case.q.shape)}")
    if append:
        # a rotated key is the rope's fp32 result rounded once: to an ulp or two of the kernel's own rounding
        check_appended(what, case, new_kv if rot is None else (rot(new_kv[0]), new_kv[1]),
                       key_ulps=0 if rot is None else 2)
    tol = 2 * base + EPS
    err_t = (out.float() - ref).abs()
    bad = int((~torch.isfinite(out)).sum())
    err = float(torch.nan_to_num(err_t, nan=float("inf")).max())
    if bad or not err <= tol:
        why = (f"{bad} non-finite outputs of {out.numel()}: it loaded a slot it does not own or past a length "
               f"(poisoned with NaN)") if bad else "wrong values"
        raise GateFailure(
            f"{what}: max error {err:.3e} vs the fp32 reference exceeds 2 x {base:.3e} (plain "
            f"{SHORT.get(dtype, dtype)} attention's error) + {EPS:g} = {tol:.3e}; {why}; worst at "
            f"{locate(case, err_t)}")
    return {"err": err, "base": base, "tol": tol}


def check_appended(what: str, case: PagedCase, new_kv, key_ulps: int = 0) -> None:
    """An appending decode kernel wrote each row's own key and value at its last slot: exactly, or the key within
    `key_ulps` of the dtype's epsilon (relative) where the kernel computed it (rotated it)."""
    kvh, d = case.k_cache.shape[2], case.k_cache.shape[3]
    slots = last_slots(case)
    eps = torch.finfo(case.k_cache.dtype).eps
    for name, cache, want in (("key", case.k_cache, new_kv[0]), ("value", case.v_cache, new_kv[1])):
        got = cache.view(-1, kvh, d)[slots]
        tol = key_ulps * eps if name == "key" else 0.0
        same = torch.isclose(got.float(), want.float(), rtol=tol, atol=tol) if tol else got == want
        bad = ~same.all(-1).all(-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0])
            raise GateFailure(f"{what}: sequence {row}'s own {name} is not in the cache at its last slot "
                                 f"{int(slots[row])} (page {case.tables[row][(case.kv_lens[row] - 1) // case.page_size]}"
                                 f", kv_len {case.kv_lens[row]}) after the decode: the append wrote it elsewhere or "
                                 f"not at all ({int(bad.sum())} of {len(slots)} rows)")


def compare_decode_kernels(backends, case: PagedCase) -> dict:
    """Run each backend's decode kernel on the same pages and hold each to the torch backend's output: they must
    agree within 3x the plain-attention error + EPS (each within 2x of the fp32 reference, torch within 1x).
    Raises GateFailure naming the pair; returns {name: max difference vs torch}."""
    dtype = case.k_cache.dtype
    scale = case.q.shape[2] ** -0.5
    torch_out = run_kernel(kernels.get_backend("torch", case.k_cache.device), "decode", case, scale).float()
    ref = reference_attention(case, scale, torch.float32)
    base = 0.0 if dtype == torch.float32 else float((reference_attention(case, scale, dtype).float() - ref).abs().max())
    tol = 3 * base + EPS
    diffs = {}
    for b in backends:
        be = _as_backend(b, case.k_cache.device, case.page_size)
        out = run_kernel(be, "decode", case, scale).float()
        d_t = (out - torch_out).abs()
        diff = float(torch.nan_to_num(d_t, nan=float("inf")).max())
        diffs[be.name] = diff
        if not diff <= tol:
            raise GateFailure(
                f"{describe(be.name, 'decode', case, dtype)}: differs from the torch decode kernel on the same pages "
                f"by {diff:.3e} > 3 x {base:.3e} + {EPS:g} = {tol:.3e}; {int((~torch.isfinite(out)).sum())} "
                f"non-finite; worst at {locate(case, d_t)}")
    return diffs
