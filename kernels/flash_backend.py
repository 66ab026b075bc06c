"""The `flash` backend: flash-attn 2's paged prefill over 256-slot pages, and a paged decode (GPU only; flash-attn is
an optional install).

- decode: kernels/triton_decode.py (the default: split by work, one query row per request), or with
  decode_kernel='flash' `flash_attn_with_kvcache(q[B, 1, H, d], k_cache, v_cache, cache_seqlens=int32[B],
  block_table=int32[B, W], softmax_scale, causal=True)`: split-KV over each request's pages;
- prefill: `flash_attn_varlen_func(q[Tq, H, d], k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
  max_seqlen_k, softmax_scale, causal=True, block_table=...)`, the paged varlen kernel (flash-attn >= 2.5); causal is
  aligned bottom-right, so each chunk sees its request's history and itself. A flash-attn without paged varlen
  delegates prefill to the `torch` backend.

Both read the pages in place through the block table and stop at each sequence's length (cache_seqlens /
cu_seqlens_k), so they never load a slot past it. Paged KV in flash-attn 2 needs pages whose size is a multiple of 256
slots and fp16 / bf16 caches.

flash-attn is imported lazily. Where it is built rather than installed (../shared/tools/flash_attn/build_flash_attn.py
prints two directories), set STEPGATE_FLASH_ATTN_PATH to them, separated by os.pathsep: they are put at the front of
sys.path before the import (kernels/envs.py).

The decode kernel, flash-attn's split count and the fused append are `EngineConfig` fields (decode_kernel,
decode_splits, decode_append), passed to the constructor: what ran is recorded with every result.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys

import torch

from .base import AttentionBackend, AttnBatch, Unavailable

# flash-attn's split-KV decode divides the block table's WIDTH (not each row's length) into num_splits parts, and its
# own heuristic (num_splits=0) picks the count from the row count alone. So a wide table (a captured decode step's
# is as wide as the longest request the engine admits: 128 pages on the 1.5B shape) leaves a long row in a few
# splits of many blocks each while most SMs idle (scripts/probes/flash_splits.py probes it; docs/RESULTS.md has the figures).
# Hence: tables are cut to the pages the rows' lengths reach (prepare), and the split count gives each split about
# BLOCKS_PER_SPLIT of flash-attn's key blocks of the table's width, at most MAX_SPLITS (0 in the variable:
# flash-attn's heuristic). Both from the same probe: 3 blocks a split was fastest at narrow tables; at wide ones
# more than 32 splits lost: past that, the empty splits' launches and the combine cost more than they save.
# Many rows fill the SMs without splitting: each (row, key/value head) is a CTA per split, and at 200 and 512 rows
# the fastest split counts gave about SPLIT_CTAS CTAs (rows x key/value heads x splits); more splits only added
# combine work (8 splits at 200 rows against the width rule's 12 and 22; 4 at 512 rows against 12).
# The decode kernel (prefill is flash-attn's varlen call either way): "triton" (the default) is
# kernels/triton_decode.py, split by work rather than by the table's width; "flash" is flash-attn's split-KV. On the
# H200 (1.5B shape, 32 rows) Triton's pure decode step took 2.14 ms of device time against 2.38, and closed 200 at
# chunk 8192 ran 57.00 req/s against 49.86 in the same call (docs/RESULTS.md).
DECODE_KERNELS = ("triton", "flash")
BLOCKS_PER_SPLIT = 3
MAX_SPLITS = 32
SPLIT_CTAS = 3072


def decode_splits_for(width_slots: int, head_dim: int, rows: int, kv_heads: int) -> int:
    """num_splits for a decode call of `rows` rows over a table `width_slots` positions wide: about
    BLOCKS_PER_SPLIT key blocks per split (flash-attn's split-KV block: 256 positions at head dim 64, 128 up to
    128, 64 above), at most MAX_SPLITS, and no more than SPLIT_CTAS CTAs over rows x kv_heads need."""
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    blocks = -(-width_slots // block_n)
    by_rows = -(-SPLIT_CTAS // max(1, rows * kv_heads))
    return max(1, min(MAX_SPLITS, by_rows, -(-blocks // BLOCKS_PER_SPLIT)))


NOT_INSTALLED = ("flash-attn is not installed (pip install flash-attn, or build it with "
                 "../shared/tools/flash_attn/build_flash_attn.py)")
PATH_ENV = "STEPGATE_FLASH_ATTN_PATH"


@functools.lru_cache(maxsize=None)
def _triton_reason() -> str | None:
    """None where triton imports, else why not: the default decode kernel needs it (checked once per process)."""
    try:
        import triton  # noqa: F401
    except Exception as e:
        return (f"the flash backend decodes with Triton (kernels/triton_decode.py) and triton does not import "
                f"({type(e).__name__}: {e}); install triton, or set EngineConfig(decode_kernel='flash') to decode "
                f"with flash-attn's split-KV")
    return None


@functools.lru_cache(maxsize=None)
def _import_flash():
    """(module, None) or (None, reason). Cached: the import is tried once per process."""
    from . import envs
    extra = [p for p in envs.get(PATH_ENV).split(os.pathsep) if p]
    for p in reversed(extra):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "flash_attn":
            return None, NOT_INSTALLED
        return None, f"flash-attn does not import ({type(e).__name__}: {e}); {NOT_INSTALLED}"
    except Exception as e:  # an extension built for another torch / CUDA, a missing symbol, ...
        return None, f"flash-attn does not import ({type(e).__name__}: {e})"
    return flash_attn, None


class FlashBackend(AttentionBackend):
    name = "flash"
    page_sizes = (256,)
    graph_safe_decode = True    # decode reads only the block table and cache lengths: capturable (engine/graphs.py)
    graph_safe_prefill = True   # paged varlen: cu_seqlens, block table; max_seqlen_q/k are bounds (step_graphs.py)
    appends_decode_kv = True    # pure decode steps' K/V written by the decode kernel (Triton's, or with_kvcache's k=)
    triton_chunk: int | None = None     # its items' keys where decode is Triton's (None: flash-attn's split-KV)
    prefill_kernel = "varlen"
    # flash-attn 2 runs fp16 and bf16 only; the Triton decode's tiles are built for the Qwen2 family's head dims
    # (64: 0.5B; 128: 1.5B, 7B): others computed wrong or non-finite attention, or a device-side assert
    dtypes = (torch.float16, torch.bfloat16)
    head_dims = (64, 128)

    decode_kernels = DECODE_KERNELS

    @classmethod
    def compiles(cls, path) -> bool:
        # the Triton decode is JIT-compiled for each head shape, dtype and the append (0.3-1 s each, 24 kernels in
        # the GPU kernel gate); flash-attn's kernels are built ahead
        return path.kernel == "triton"

    def __init__(self, decode_kernel: str | None = None, decode_splits: int | None = None,
                 decode_append: bool | None = None, dynamic: bool | None = None):
        """decode_kernel: 'triton' (kernels/triton_decode.py, the default) or 'flash' (flash-attn's split-KV);
        decode_splits: flash-attn's num_splits for every decode call (0: its own heuristic; None: per call from the
        table's width and the rows, decode_splits_for); decode_append: False writes a pure decode step's K/V with
        the model's index_put kernels, as before the append."""
        super().__init__(decode_kernel, decode_splits, decode_append, dynamic)
        if self.decode_splits is not None and not 0 <= self.decode_splits <= 128:
            raise ValueError(f"flash decode splits must be in 0..128 (flash-attn's limit), got {self.decode_splits}")
        if self.decode_kernel == "triton":
            from . import triton_decode
            self.triton_chunk = triton_decode.CHUNK
            # the Triton decode's append also rotates (flash-attn's split-KV gets its keys rotated by the model)
            self.rotates_decode = self.appends_decode_kv
            # its persistent grid loops to the step's last item: a table's width costs nothing past the rows' pages
            self.width_free_decode = True
        fa, reason = _import_flash()
        if fa is None:
            raise Unavailable(reason)
        if self.triton_chunk is not None and (reason := _triton_reason()):
            raise Unavailable(reason)
        self._bind_flash()

    @classmethod
    def takes_splits(cls, kernel: str) -> bool:
        return kernel == "flash"

    def _bind_flash(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self._with_kvcache = flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func
        self.paged_prefill = "block_table" in inspect.signature(flash_attn_varlen_func).parameters
        self._fallback = None
        if not self.paged_prefill:
            from .torch_backend import TorchBackend
            self._fallback = TorchBackend()
            self.graph_safe_prefill = False
            self.prefill_kernel = self._fallback.prefill_kernel     # the census names what runs

    @classmethod
    def why_unavailable(cls, device: torch.device, page_size: int | None = None,
                        decode_kernel: str | None = None) -> str | None:
        device = torch.device(device)
        if device.type != "cuda":
            return "flash-attn needs a CUDA device"
        if not torch.cuda.is_available():
            return "flash-attn needs a CUDA device (none is visible)"
        _, reason = _import_flash()
        if reason:
            return reason
        if (decode_kernel or DECODE_KERNELS[0]) == "triton" and (reason := _triton_reason()):
            return reason
        return super().why_unavailable(device, page_size)

    def _check(self, q, k_cache):
        self.check_call(q, k_cache)
        if k_cache.shape[1] % 256:
            raise Unavailable(f"flash-attn 2's paged kernels need pages of a multiple of 256 slots, "
                              f"got {k_cache.shape[1]}")

    def prepare(self, batch: AttnBatch, kind: str) -> None:
        bt = batch.block_tables
        if kind == "decode":
            # only the pages the rows' lengths reach: split-KV work scales with the table's width (see above). A
            # captured step passes lengths as wide as its table, so its table is kept whole.
            need = -(-max(batch.kv_lens) // batch.page_size)
            if need < bt.shape[1]:
                bt = bt[:, :need]
        if bt.dtype != torch.int32 or bt.stride(-1) != 1:   # flash-attn takes any row stride
            bt = bt.to(torch.int32).contiguous()
        seqlens = batch.kv_lens_t.to(torch.int32).contiguous()
        if kind == "decode":
            # with new_kv, flash-attn writes the new key and value at cache_seqlens and attends over one more
            batch.prepared[kind] = ("decode", bt, seqlens, seqlens - 1)
            return
        if self._fallback is not None:
            self._fallback.prepare(batch, kind)
            return
        cu_k = torch.zeros(batch.num_seqs + 1, dtype=torch.int32, device=bt.device)
        cu_k[1:] = torch.cumsum(seqlens, 0)
        batch.prepared[kind] = ("prefill", bt, batch.cu_q_t.to(torch.int32).contiguous(), cu_k)

    def decode(self, q, k_cache, v_cache, batch, scale, new_kv=None, rope=None):
        self._check(q, k_cache)
        tag, bt, seqlens, before = batch.prepared["decode"]
        if rope is not None and not self.rotates_decode:
            raise ValueError(f"the flash backend's {self.decode_kernel} decode (decode_append="
                             f"{self.appends_decode_kv}) does not rotate: rope must not be passed to it")
        if self.triton_chunk is not None:
            return self._decode_triton(q, k_cache, v_cache, batch, scale, new_kv, rope)
        self.took("decode", "flash", new_kv is not None)
        splits = self.decode_splits
        if splits is None:
            splits = decode_splits_for(bt.shape[1] * k_cache.shape[1], q.shape[-1], q.shape[0], k_cache.shape[2])
        append = {}
        if new_kv is not None:
            # the cache write in the kernel: two index_put kernels a layer fewer (0.18 ms of a 32-row pure decode
            # step of the 1.5B shape on the H200); the split that holds the new position writes it, then reads it
            append = dict(k=new_kv[0].unsqueeze(1), v=new_kv[1].unsqueeze(1))
            seqlens = before
        out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=seqlens, block_table=bt,
                                 softmax_scale=scale, causal=True, num_splits=splits, **append)
        return out.squeeze(1)

    def decode_into(self, q, k_cache, v_cache, batch, scale, out, is_decode, count):
        """The Triton decode's combine writes the decode rows into `out` itself (only rows below `count`): no merge
        kernel a layer (28 in a loaded step of the 1.5B shape; by its name the elementwise kernel of 87 us in an
        H100's 5.07 ms loaded step in session 33)."""
        if self.triton_chunk is None:
            return super().decode_into(q, k_cache, v_cache, batch, scale, out, is_decode, count)
        self._check(q, k_cache)
        self._decode_triton(q, k_cache, v_cache, batch, scale, None, out=out, out_rows=count)

    def _decode_triton(self, q, k_cache, v_cache, batch, scale, new_kv, rope=None, out=None, out_rows=None):
        """kernels/triton_decode.py's decode; its work items are made by the step's first layer and kept in the
        batch for the others (inside a captured step they are made in the graph, from the device lengths). `out`,
        `out_rows`: paged_decode's (decode_into)."""
        from . import triton_decode as td
        self.took("decode", "triton", new_kv is not None)
        _, bt, seqlens, before = batch.prepared["decode"]
        cached = before if new_kv is not None else seqlens
        key = ("triton-items", new_kv is not None)
        items = batch.prepared.get(key)
        if items is None:
            pages, page_size = k_cache.shape[0], k_cache.shape[1]
            grid = td.max_items(q.shape[0], bt.shape[1] * page_size, pages * page_size, self.triton_chunk)
            items = batch.prepared[key] = td.work_items(cached, grid, self.triton_chunk, bt, page_size)
        return td.paged_decode(q, k_cache, v_cache, bt, cached, scale, new_kv, chunk=self.triton_chunk,
                               items=items, rope=rope, out=out, out_rows=out_rows, pdl=self.pdl)

    def prefill(self, q, k_cache, v_cache, batch, scale):
        if self._fallback is not None:
            self.took("prefill", self._fallback.prefill_kernel)
            return self._fallback.prefill(q, k_cache, v_cache, batch, scale)
        self.took("prefill", "varlen")
        self._check(q, k_cache)
        tag, bt, cu_q, cu_k = batch.prepared["prefill"]
        return self._varlen(q, k_cache, v_cache, cu_q, cu_k, batch.max_q, batch.max_kv, softmax_scale=scale,
                            causal=True, block_table=bt)


__all__ = ["DECODE_KERNELS", "FlashBackend", "NOT_INSTALLED", "PATH_ENV", "decode_splits_for"]
