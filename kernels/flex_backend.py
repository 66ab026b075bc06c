"""The `flex` backend: FlexAttention (torch.nn.attention.flex_attention) with block masks, over the paged cache.

How it reads the pages. FlexAttention loads whole KV blocks and applies the mask to the scores afterwards, so it
cannot run on the paged cache in place: the tail of a request's last page (never written, NaN in poison mode) would
be loaded, and `0 * NaN = NaN` poisons the output however well the scores are masked. So once per step `prepare`
builds gather indices of exactly the slots each sequence owns below its length, padding pointing at the null slot 0
(page 0, always zero), and per layer the K/V are gathered into a dense, zero-padded tensor that flex reads:

- prefill (packed): every sequence's valid history is packed back to back, [1, kv_heads, Tk, d]; the queries are the
  packed chunk positions, [1, heads, Tq, d]; the block mask is the document mask (same sequence) and causal (key
  position <= query position);
- decode, 'rows' layout (the default): one query row per request as a batch entry, [R, heads, 1, d], each against
  its own history padded to the longest, [R, kv_heads, L, d], with the length mask. Block sparsity skips the padded
  blocks, but the gather writes R x L slots;
- decode, 'packed' layout (`FlexBackend('packed')`, EngineConfig(decode_kernel='packed')): the decode rows are the queries of
  one call, [1, heads, R, d], against every request's valid history packed back to back, [1, kv_heads, Tk, d], with
  the document mask; the gather copies each valid slot once, but every key block is computed for all R rows.

GQA goes through `enable_gqa=True`; the softmax scale is passed as is.

Compiled shapes. `flex_attention` is compiled once per process, and each step's dims are padded to a ladder so
that the set of shapes stays finite and small:
- key dims (Tk, L): 128 x {2, 3, 4, 6, 8, 12, 16, ...} (powers of two and 1.5x powers of two, at least two flex
  blocks of 128), so padding wastes at most a third of the gathered keys;
- query dim (Tq for prefill): the next power of two, at least two blocks;
- decode rows R: the next multiple of 32 (the default max batch); padding rows own no key.
On CUDA the padded lengths are dynamic (`torch.compile(dynamic=True)`, batch and head dims marked static, no duck
sizing): one graph per kind (decode, prefill) serves every rung, which is why the ladder starts at two blocks (a dim
of one block would be specialised into a graph of its own). Batch and heads stay static because Inductor's split-KV
decode kernel needs them so, and the compiled function tells Inductor the lengths are whole blocks (its fast path).
On CPU each padded shape compiles statically (see `dynamic_shapes` for why); EngineConfig(flex_dynamic=...)
forces either. `warmup(...)` runs every shape of the ladder an engine configuration can reach (see `ladder_shapes`), so
that no measured step includes a compile; `compiled_shapes` lists what this process has run. A new (heads,
kv_heads, head_dim, dtype, device, scale) compiles anew. Dynamo's recompile limit is raised so that it never falls
back to eager flex_attention after 8 graphs.
STEPGATE_COMPILE_CACHE=DIR keeps the compiled code in DIR across processes (kernels/compile_cache.py).

Block masks are built per step at block granularity from the dense mask (partial blocks get the mask_mod, full blocks
skip it), which costs a few elementwise ops rather than create_block_mask's vmap.

Costs: the gather writes K and V once more per layer (padding included), which is why this backend is the portable
kernel and `flash` the decode kernel for speed (bench/kernel_bench.py measures both layouts; docs/RESULTS.md).
"""
from __future__ import annotations

import functools
import shutil

import torch
import torch._dynamo

from . import envs
from .base import AttentionBackend, AttnBatch
from .flex_shapes import BLOCK, MIN_BLOCKS, ROWS, block_mask_from_dense, kv_bucket, ladder, q_bucket, rows_bucket

COMPILER = "inductor"  # torch.compile's backend; tests/test_flex_compile.py checks the dynamic path with "aot_eager"


def dynamic_shapes(device_type: str = "cuda") -> bool:
    """Whether flex compiles dynamic lengths by default on this device type (EngineConfig.flex_dynamic decides; None
    takes this): on CUDA only. Not on CPU: Inductor's C++ flex template (torch 2.13) writes its split sizes into the
    generated code by text replacement of a size symbol's name (`ks1`), which also hits longer names (`ks18` ->
    `cur_kvSplitSize8`), and the code then fails to compile (seen on the prefill mask)."""
    return device_type == "cuda"


def _attend_blocks(q, k, v, block_mask, scale):
    """flex_attention, telling Inductor which lengths are whole blocks (the ladder's keys and prefill queries), so
    that it keeps its divisible-length kernel when the lengths are symbolic."""
    from torch.nn.attention.flex_attention import flex_attention
    for n in (q.size(2), k.size(2)):
        if n % BLOCK == 0:          # a guard; decode rows (one query each, or 32 packed) are not whole blocks
            torch._check(n % BLOCK == 0)
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def _no_duck_shapes():
    import contextlib
    from torch.fx.experimental import _config as fx_config
    if not hasattr(fx_config, "use_duck_shape"):        # pragma: no cover - older torch
        return contextlib.nullcontext()
    return fx_config.patch(use_duck_shape=False)


@functools.lru_cache(maxsize=None)
def _flex(dynamic: bool, compiler: str = "inductor"):
    """The compiled flex attention, created once per process and mode (its graphs are shared by every instance)."""
    from .compile_cache import use_compile_cache
    use_compile_cache()      # STEPGATE_COMPILE_CACHE, before the first compile
    # past dynamo's recompile limit (8 by default) it would silently fall back to the eager, unfused
    # flex_attention: each static shape is one more entry. Raise it (both spellings).
    cfg = torch._dynamo.config
    for name, at_least in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                           ("accumulated_recompile_limit", 8192), ("accumulated_cache_size_limit", 8192)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), at_least))
    # fullgraph: a graph break inside would otherwise run part of flex eagerly, unseen
    return torch.compile(_attend_blocks, dynamic=dynamic, fullgraph=True, backend=compiler)


def _flex_import_error() -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception as e:  # pragma: no cover - torch < 2.5
        return f"torch {torch.__version__} has no FlexAttention ({type(e).__name__}: {e})"
    return None


# A warm-up already run in this process: (compile mode, compiler, heads, kv heads, head dim, dtype, device, scale,
# page size, decode layout, kind, max_kv, max_prefill_tokens, max_prefill_kv, max_rows) -> (the padded shapes its
# calls ran (FlexBackend.compiled_shapes' keys), the ids of Dynamo's compiled entries for the attention after it).
# The serial GPU gates build 14 fused-flex engines of one configuration (session 40's by-configuration line), and each
# ran its whole ladder again; the first one's compile is most of the suite's flex warm-up (9.9-17.6 s cold).
_WARMED: dict[tuple, tuple[frozenset, frozenset]] = {}


def _compiled_entries() -> frozenset | None:
    """Ids of Dynamo's compiled entries for the attention's code: torch._dynamo.reset() drops them (tests reset it),
    so a warm-up recorded before a reset no longer counts as done. None where this torch cannot say (never skip)."""
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        return frozenset(map(id, _debug_get_cache_entry_list(_attend_blocks.__code__)))
    except Exception:  # noqa: BLE001 (a private helper: without it, every warm-up runs, as before)
        return None


class FlexBackend(AttentionBackend):
    name = "flex"

    DECODE_LAYOUTS = ("rows", "packed")
    decode_kernels = DECODE_LAYOUTS
    prefill_kernel = "packed"
    head_dims = (64, 128)       # what the kernel gate compiles and checks (each head dim compiles its own kernels)
    compiles_per_shape = True   # torch.compile'd flex_attention: a kernel per head shape and dtype

    def __init__(self, decode_kernel: str | None = None, decode_splits: int | None = None,
                 decode_append: bool | None = None, dynamic: bool | None = None):
        """decode_kernel, the decode layout: 'rows' (the default): one flex batch entry per request, each against its
        own history padded to the longest one; 'packed': the decode rows as the queries of one flex call over all
        requests' histories packed back to back (see the module's docstring for both, and timings). dynamic: compile
        dynamic lengths (None: dynamic_shapes' default for the device the first call runs on)."""
        super().__init__(decode_kernel, decode_splits, decode_append, dynamic)
        self._dynamic_given = dynamic
        self.compiled_shapes: set[tuple] = set()

    @property
    def decode_layout(self) -> str:
        return self.decode_kernel

    @decode_layout.setter
    def decode_layout(self, layout: str) -> None:
        self.decode_kernel = layout

    @classmethod
    def default_dynamic(cls, device_type: str) -> bool:
        return dynamic_shapes(device_type)

    # -- availability ----------------------------------------------------------------------------------------
    @classmethod
    def why_unavailable(cls, device: torch.device, page_size: int | None = None,
                        decode_kernel: str | None = None) -> str | None:
        reason = super().why_unavailable(device, page_size, decode_kernel)
        if reason:
            return reason
        reason = _flex_import_error()
        if reason:
            return reason
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return "FlexAttention needs CUDA here: no CUDA device is visible"
            try:
                from torch.utils._triton import has_triton
                if not has_triton():
                    return "FlexAttention on CUDA needs Triton, which is not installed"
            except ImportError:  # pragma: no cover
                pass
            return None
        if device.type == "cpu":
            # Inductor compiles flex to C++ on CPU (measured here: ~10-25 s per new shape cold, ~2 s from its cache)
            if envs.get("STEPGATE_FLEX_CPU") == "0":
                return "FlexAttention needs CUDA here: CPU runs are switched off (STEPGATE_FLEX_CPU=0)"
            if not (envs.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
                return "FlexAttention needs CUDA here: compiling it on CPU needs a C++ compiler and none was found"
            return None
        return f"FlexAttention needs CUDA here: device type {device.type!r} is not supported"

    # -- per step ----------------------------------------------------------------------------------------------
    def prepare(self, batch: AttnBatch, kind: str) -> None:
        # all flex inputs (block masks included) are made in inference mode, whatever the caller's mode: dynamo
        # guards on a tensor's dispatch keys, so mixing modes would compile every shape twice
        with torch.inference_mode():
            self._prepare(batch, kind)

    def _prepare(self, batch: AttnBatch, kind: str) -> None:
        if kind == "decode":
            assert all(n == 1 for n in batch.q_lens), "decode takes one query row per request"
            if self.decode_layout == "rows":
                return self._prepare_rows(batch)
            return self._prepare_packed(batch, kind, rows_bucket(batch.num_seqs))
        return self._prepare_packed(batch, kind, q_bucket(batch.num_queries))

    def _prepare_rows(self, batch: AttnBatch) -> None:
        """Decode as a batch of rows: row b is request b's query against its own gathered history [L]."""
        dev = batch.block_tables.device
        P, bt, B = batch.page_size, batch.block_tables.long(), batch.num_seqs
        kv_lens = batch.kv_lens_t.long()
        R, L = rows_bucket(B), kv_bucket(batch.max_kv)
        j = torch.arange(L, device=dev)
        width = bt.shape[1]
        pages = bt.gather(1, (j // P).clamp(max=width - 1).expand(B, -1))
        slots = torch.where(j < kv_lens[:, None], pages * P + j % P, torch.zeros_like(pages))
        slots = torch.cat([slots, slots.new_zeros(R - B, L)]) if R > B else slots       # [R, L]
        lens = torch.cat([kv_lens, kv_lens.new_zeros(R - B)]) if R > B else kv_lens      # [R]

        def length_mask(b, h, q_idx, kv_idx):
            return kv_idx < lens[b]

        mask = block_mask_from_dense((j[None, :] < lens[:, None])[:, None, :], length_mask, 1, L)
        batch.prepared["decode"] = ("rows", slots, mask, R, L)

    def _prepare_packed(self, batch: AttnBatch, kind: str, Tq_p: int) -> None:
        """Packed queries (Tq_p rows) against all sequences' valid histories packed back to back, with the document
        mask (same sequence) and causal (key position <= query position)."""
        dev = batch.block_tables.device
        P, bt, B = batch.page_size, batch.block_tables.long(), batch.num_seqs
        kv_lens = batch.kv_lens_t.long()
        Tq, Tk = batch.num_queries, sum(batch.kv_lens)
        Tk_p = kv_bucket(Tk)
        seqs = torch.arange(B, device=dev)
        q_lens = torch.tensor(batch.q_lens, device=dev)
        cu_k = torch.zeros(B + 1, dtype=torch.long, device=dev)
        cu_k[1:] = torch.cumsum(kv_lens, 0)
        kv_doc = torch.repeat_interleave(seqs, kv_lens, output_size=Tk)
        kv_pos = torch.arange(Tk, device=dev) - cu_k[kv_doc]
        kv_slot = bt[kv_doc, kv_pos // P] * P + kv_pos % P
        q_doc = torch.repeat_interleave(seqs, q_lens, output_size=Tq)
        q_pos = (kv_lens - q_lens)[q_doc] + torch.arange(Tq, device=dev) - batch.cu_q_t.long()[q_doc]
        pad_k, pad_q = Tk_p - Tk, Tq_p - Tq
        kv_slot = torch.cat([kv_slot, kv_slot.new_zeros(pad_k)])          # padding: the null slot
        kv_doc = torch.cat([kv_doc, kv_doc.new_full((pad_k,), -1)])       # padding keys belong to no sequence
        kv_pos = torch.cat([kv_pos, kv_pos.new_zeros(pad_k)])
        q_doc = torch.cat([q_doc, q_doc.new_full((pad_q,), -2)])          # padding queries see nothing
        q_pos = torch.cat([q_pos, q_pos.new_zeros(pad_q)])

        def document_causal(b, h, q_idx, kv_idx):
            return (q_doc[q_idx] == kv_doc[kv_idx]) & (kv_pos[kv_idx] <= q_pos[q_idx])

        dense = (q_doc[:, None] == kv_doc[None, :]) & (kv_pos[None, :] <= q_pos[:, None])
        mask = block_mask_from_dense(dense[None], document_causal, Tq_p, Tk_p)
        batch.prepared[kind] = ("packed", kv_slot, mask, Tq_p, Tk_p)

    # -- per layer ---------------------------------------------------------------------------------------------
    def _attend(self, q, k, v, mask, scale):
        key = (tuple(q.shape), tuple(k.shape), q.dtype, q.device.type, float(scale))
        self.compiled_shapes.add(key)
        if self._dynamic_given if self._dynamic_given is not None else dynamic_shapes(q.device.type):
            for t in (q, k, v):      # batch and heads: static (the split-KV decode kernel needs them so)
                torch._dynamo.mark_static(t, 0)
                torch._dynamo.mark_static(t, 1)
            # no duck sizing: lengths equal at the first compile (a fresh prompt's Tq_p == Tk_p) would share one
            # symbol, a graph of their own, and Inductor's CPU flex template miscompiles it (torch 2.13)
            with _no_duck_shapes():
                return _flex(True, COMPILER)(q, k, v, mask, float(scale))
        return _flex(False, COMPILER)(q, k, v, mask, float(scale))

    def prefill(self, q, k_cache, v_cache, batch, scale):
        self.check_call(q, k_cache)
        return self._in_inference_mode(self._prefill, q, k_cache, v_cache, batch, scale)

    def decode(self, q, k_cache, v_cache, batch, scale):
        self.check_call(q, k_cache)
        return self._in_inference_mode(self._decode, q, k_cache, v_cache, batch, scale)

    @staticmethod
    def _in_inference_mode(fn, *args):
        """Gather, pad and attend in inference mode (see prepare); a caller outside it gets a normal tensor back."""
        if torch.is_inference_mode_enabled():
            return fn(*args)
        with torch.inference_mode():
            out = fn(*args)
        return out.clone()

    def _prefill(self, q, k_cache, v_cache, batch, scale):
        self.took("prefill", "packed")
        return self._packed(q, k_cache, v_cache, batch.prepared["prefill"], scale)

    def _decode(self, q, k_cache, v_cache, batch, scale):
        prepared = batch.prepared["decode"]
        self.took("decode", prepared[0])
        if prepared[0] == "packed":
            return self._packed(q, k_cache, v_cache, prepared, scale)
        return self._rows(q, k_cache, v_cache, prepared, scale)

    def _packed(self, q, k_cache, v_cache, prepared, scale):
        tag, kv_slot, mask, Tq_p, Tk_p = prepared
        assert tag == "packed"
        Tq, H, d = q.shape
        kvh = k_cache.shape[2]
        k = k_cache.view(-1, kvh, d)[kv_slot].transpose(0, 1).unsqueeze(0)     # [1, kvh, Tk_p, d]
        v = v_cache.view(-1, kvh, d)[kv_slot].transpose(0, 1).unsqueeze(0)
        qp = q.new_zeros(Tq_p, H, d)
        qp[:Tq] = q
        o = self._attend(qp.transpose(0, 1).unsqueeze(0), k, v, mask, scale)   # [1, H, Tq_p, d]
        return o[0, :, :Tq].transpose(0, 1)

    def _rows(self, q, k_cache, v_cache, prepared, scale):
        tag, slots, mask, R, L = prepared
        assert tag == "rows"
        B, H, d = q.shape
        kvh = k_cache.shape[2]
        k = k_cache.view(-1, kvh, d)[slots].transpose(1, 2)                    # [R, kvh, L, d]
        v = v_cache.view(-1, kvh, d)[slots].transpose(1, 2)
        qp = q.new_zeros(R, H, 1, d)
        qp[:B, :, 0] = q
        o = self._attend(qp, k, v, mask, scale)                                # [R, H, 1, d]
        return o[:B, :, 0]

    # -- compile up front --------------------------------------------------------------------------------------
    def ladder_shapes(self, max_kv: int, max_prefill_tokens: int, max_prefill_kv: int | None = None,
                      max_rows: int = ROWS) -> dict[str, list[tuple[int, int]]]:
        """The padded (query rows, keys) shapes an engine can reach, per kind.

        max_kv: the longest history a request can have (prompt + budget); max_prefill_tokens: the most query
        positions in one prefill call (chunk_tokens, or the longest teacher-forced sequence); max_prefill_kv: the
        most history slots in one prefill call, all its sequences together (default max_kv + max_prefill_tokens:
        first-come-first-served chunking puts at most one request with history in a step beside fresh prompts);
        max_rows: the most decode requests in a step (max_batch)."""
        if max_prefill_kv is None:
            max_prefill_kv = max_kv + max_prefill_tokens
        rows = sorted({rows_bucket(r) for r in range(1, max_rows + 1)})
        if self.decode_layout == "rows":     # (rows, longest history)
            decode = [(r, L) for r in rows for L in ladder(max_kv)]
        else:                                # (rows, all histories together)
            decode = [(r, tk) for r in rows for tk in ladder(min(r, max_rows) * max_kv)]
        prefill = [(tq, tk) for tq in ladder(max_prefill_tokens, q_bucket) for tk in ladder(max_prefill_kv)
                   if tk >= tq]
        return {"decode": decode, "prefill": prefill}

    def warmup(self, num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
               max_kv: int, max_prefill_tokens: int, max_prefill_kv: int | None = None, max_rows: int = ROWS,
               scale: float | None = None, page_size: int = 64, kinds=("decode", "prefill")) -> int:
        """Compile every shape of the ladder (see `ladder_shapes`) for this model shape; returns how many calls ran
        (0: this process ran this very warm-up before and Dynamo still holds its graphs, so it is not run again).

        Runs each shape once through prepare + prefill/decode on a two-page cache whose page 1 stands for every
        page, so the compiled graphs are exactly those the engine's steps hit. Call it after building the engine
        (num_heads etc. from its ModelShape, scale = head_dim ** -0.5) and before any measured step."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        scale = head_dim ** -0.5 if scale is None else scale
        # this process ran these very calls, and Dynamo still holds what they compiled: nothing is left to compile
        dynamic = self._dynamic_given if self._dynamic_given is not None else dynamic_shapes(device.type)
        memo = (dynamic, COMPILER, num_heads, kv_heads, head_dim, dtype, str(device), float(scale),
                page_size, self.decode_layout, tuple(kinds), max_kv, max_prefill_tokens, max_prefill_kv, max_rows)
        done, entries = _WARMED.get(memo), _compiled_entries()
        if done is not None and entries is not None and done[1] is not None and done[1] <= entries:
            self.compiled_shapes |= done[0]
            return 0
        kept, self.compiled_shapes = self.compiled_shapes, set()     # to record the shapes this warm-up runs
        shapes = self.ladder_shapes(max_kv, max_prefill_tokens, max_prefill_kv, max_rows)
        kc = torch.zeros(2, page_size, kv_heads, head_dim, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        n = 0

        def batch_of(q_lens, kv_lens):
            width = max(-(-k // page_size) for k in kv_lens)
            bt = torch.ones(len(kv_lens), width, dtype=torch.int32, device=device)
            cu = [0]
            for x in q_lens:
                cu.append(cu[-1] + x)
            return AttnBatch(list(q_lens), list(kv_lens), bt, torch.tensor(kv_lens, dtype=torch.int32, device=device),
                             torch.tensor(cu, dtype=torch.int32, device=device), page_size)

        def run(kind, q_lens, kv_lens):
            b = batch_of(q_lens, kv_lens)
            self.prepare(b, kind)
            q = torch.zeros(sum(q_lens), num_heads, head_dim, dtype=dtype, device=device)
            (self.decode if kind == "decode" else self.prefill)(q, kc, vc, b, scale)

        try:
            for kind in kinds:
                for rows, tk in shapes[kind]:
                    if kind == "prefill":
                        run(kind, [rows], [tk])
                    elif self.decode_layout == "rows":
                        run(kind, [1] * rows, [tk] * rows)
                    else:     # histories summing to tk: one long, the rest one slot each
                        run(kind, [1] * rows, [tk - (rows - 1)] + [1] * (rows - 1))
                    n += 1
            _WARMED[memo] = (frozenset(self.compiled_shapes), _compiled_entries())
        finally:
            self.compiled_shapes |= kept
        return n


__all__ = ["FlexBackend", "q_bucket", "kv_bucket", "rows_bucket", "ladder", "block_mask_from_dense", "dynamic_shapes",
           "BLOCK", "MIN_BLOCKS", "ROWS"]
