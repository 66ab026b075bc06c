"""The attention backend interface: prefill over packed chunk positions and decode with one query row per request,
both over the same paged cache. Per-layer cache tensors have flash-attn's paged layout
[num_pages, page_size, kv_heads, head_dim]."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import ConfigError


@dataclass
class AttnBatch:
    """One attention call's sequences, built once per step and shared by every layer.

    Query rows are packed: sequence b owns rows [cu_q[b], cu_q[b+1]), the last q_lens[b] positions of a history of
    kv_lens[b] slots (its chunk or decode token included, already written to the cache)."""
    q_lens: list[int]                 # host copies: bookkeeping and shapes
    kv_lens: list[int]
    block_tables: torch.Tensor        # [B, max_pages] int32, padded with the null page
    kv_lens_t: torch.Tensor           # [B] int32 on the device
    cu_q_t: torch.Tensor              # [B + 1] int32 on the device
    page_size: int
    prepared: dict = field(default_factory=dict)   # backend-specific per-step tensors (gather indices, masks)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_queries(self) -> int:
        return sum(self.q_lens)

    @property
    def max_q(self) -> int:
        return max(self.q_lens, default=0)

    @property
    def max_kv(self) -> int:
        return max(self.kv_lens, default=0)


class Unavailable(ConfigError):
    """A backend cannot run here; the message says why (gates skip with it). A ConfigError: the engine's config
    names a backend this device cannot serve with."""


@dataclass(frozen=True)
class KernelPath:
    """One kernel a backend can run: its call ('prefill' or 'decode'), its kernel, and for decode whether the kernel
    writes the step's own keys and values itself (the append). Backends declare theirs (declared_paths); the runner
    counts the ones a run takes (the path census) and the kernel gate checks each declared one against fp32, so a
    path taken that no check covered fails the coverage gate."""
    backend: str
    op: str
    kernel: str
    append: bool = False

    @property
    def name(self) -> str:
        return f"{self.backend}.{self.op}.{self.kernel}" + ("+append" if self.append else "")

    def options(self) -> dict:
        """The backend's constructor options that make it run this path."""
        return {"decode_kernel": self.kernel} if self.op == "decode" else {}


class AttentionBackend:
    name = "base"
    page_sizes: tuple[int, ...] | None = None   # None: any page size
    # True when decode reads only device tensors whose shapes depend on the batch size alone (the block table, of a
    # fixed width, and the cache lengths), so a CUDA graph can capture it (engine/graphs.py)
    graph_safe_decode: bool = False
    # True when prefill reads only device tensors (block table, cache lengths, query offsets) whose shapes depend on
    # host bounds alone (sequences, query rows, the longest sequence), so a loaded or chunk-only step that passes
    # bounds can be captured (engine/step_graphs.py)
    graph_safe_prefill: bool = False
    # True when both calls are correct over a captured step's static buffers (a table as wide as the widest request,
    # lengths and bounds on the device) however slow: a CPU, where nothing is captured, can then run the captured
    # steps' path uncaptured (EngineConfig(cuda_graphs=True) there), so the CPU gates reach steps launched ahead
    static_steps: bool = False
    # True when decode can take the step's new keys and values (new_kv) and write them itself, at each row's last
    # position (kv_lens - 1), before it attends: a pure decode step then launches no separate cache writes. An
    # instance's `appends_decode_kv` is what it does (EngineConfig.decode_append; this class value is its default).
    appends_decode_kv: bool = False
    # True when, appending, decode also applies the rotary embedding (decode(..., rope=(cos, sin))): the model then
    # hands it the rows' queries and new keys unrotated and launches no rotary kernel in a pure decode step. An
    # instance's value says what it does (flash: its Triton decode with the append)
    rotates_decode: bool = False
    # True when decode's cost follows the rows' lengths, not the block table's width (its grid and loops stop at each
    # row's length): captured steps then need one table width, not a ladder of them (engine/graphs.py). An
    # instance's value says what its decode kernel does (flash: the Triton decode; flash-attn's split-KV is not)
    width_free_decode: bool = False
    # True when the backend compiles a kernel for each head shape and dtype it meets (FlexAttention): the GPU gate run
    # compiles those of its kernel gate ahead, in parallel processes (gates/prewarm.py)
    compiles_per_shape: bool = False
    # its Triton decode launched with programmatic dependent launch (EngineConfig.pdl: build_runner sets it; the
    # flash backend's Triton decode reads it, kernels/pdl.py)
    pdl: bool = False
    # the decode kernels this backend can run (EngineConfig.decode_kernel); the first is its default
    decode_kernels: tuple[str, ...] = ("default",)
    prefill_kernel: str = "default"
    # what the kernels are built and checked for: anything else is refused with Unavailable before a launch
    # (None: any). GQA: query heads per key/value head.
    head_dims: tuple[int, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    gqa_ratios: tuple[int, ...] | None = None

    @classmethod
    def declared_paths(cls) -> list[KernelPath]:
        """Every kernel path this backend can take: the registry the kernel gate's cases come from."""
        out = [KernelPath(cls.name, "prefill", cls.prefill_kernel)]
        for kernel in cls.decode_kernels:
            out.append(KernelPath(cls.name, "decode", kernel))
            if cls.appends_decode_kv:
                out.append(KernelPath(cls.name, "decode", kernel, append=True))
        return out

    @classmethod
    def compiles(cls, path: KernelPath) -> bool:
        """Whether `path`'s kernel is compiled for each head shape and dtype it meets (gates/prewarm.py compiles the
        kernel gate's cases of such paths ahead)."""
        return cls.compiles_per_shape

    def path(self, op: str, append: bool = False) -> KernelPath:
        """The path this instance takes for a call."""
        return KernelPath(self.name, op, self.prefill_kernel if op == "prefill" else self.decode_kernel, append)

    @classmethod
    def why_unsupported(cls, head_dim: int | None = None, dtype: torch.dtype | None = None, num_heads: int | None = None,
                        kv_heads: int | None = None) -> str | None:
        """None if the kernels support this shape and dtype, else why not (the backend refuses it: Unavailable)."""
        if head_dim is not None and cls.head_dims is not None and head_dim not in cls.head_dims:
            return (f"the {cls.name} backend's kernels are built for head dims {', '.join(map(str, cls.head_dims))}, "
                    f"not {head_dim}")
        if dtype is not None and cls.dtypes is not None and dtype not in cls.dtypes:
            return (f"the {cls.name} backend runs {', '.join(str(d).removeprefix('torch.') for d in cls.dtypes)}, "
                    f"not {str(dtype).removeprefix('torch.')}")
        if num_heads is not None and kv_heads is not None:
            if kv_heads < 1 or num_heads % kv_heads:
                return f"{num_heads} query heads do not split evenly over {kv_heads} key/value heads"
            ratio = num_heads // kv_heads
            if cls.gqa_ratios is not None and ratio not in cls.gqa_ratios:
                return (f"the {cls.name} backend's kernels take {', '.join(map(str, cls.gqa_ratios))} query heads per "
                        f"key/value head, not {ratio}")
        return None

    def check_call(self, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        """Refuse, before any launch, a call whose head dim, dtype or GQA ratio the kernels are not built for."""
        reason = self.why_unsupported(q.shape[-1], k_cache.dtype, q.shape[-2], k_cache.shape[2])
        if reason:
            raise Unavailable(reason)

    def __init__(self, decode_kernel: str | None = None, decode_splits: int | None = None,
                 decode_append: bool | None = None, dynamic: bool | None = None):
        """The EngineConfig fields that pick what this backend runs, resolved by `options` (None: the default)."""
        opts = self.options(decode_kernel, decode_splits, decode_append, dynamic)
        self.decode_kernel = opts["decode_kernel"]
        self.decode_splits = opts["decode_splits"]
        self.appends_decode_kv = opts["decode_append"]
        self.dynamic = opts["dynamic"]
        # (op, kernel, append) of every call's branch, recorded as it dispatches (inside a captured step: at capture);
        # the gates compare them with the kernel paths the census names from the configuration (gates/dispatch.py)
        self.dispatched: set[tuple[str, str, bool]] = set()

    def took(self, op: str, kernel: str, append: bool = False) -> None:
        """Record that a call dispatched to `kernel` (see `dispatched`)."""
        self.dispatched.add((op, kernel, append))

    @classmethod
    def options(cls, decode_kernel: str | None = None, decode_splits: int | None = None,
                decode_append: bool | None = None, dynamic: bool | None = None, device_type: str = "cuda") -> dict:
        """The backend's choices with every None decided: the decode kernel (its first by default), flash-attn's
        split count (None: per call), the fused append (the class's default; only where the kernel can), the
        compile mode. A choice this backend does not have raises ValueError naming it."""
        kernel = decode_kernel or cls.decode_kernels[0]
        if kernel not in cls.decode_kernels:
            raise ValueError(f"decode_kernel={kernel!r}: the {cls.name} backend decodes with "
                             f"{' or '.join(map(repr, cls.decode_kernels))}")
        if decode_append and not cls.appends_decode_kv:
            raise ValueError(f"decode_append=True: the {cls.name} backend's decode does not write the step's keys "
                             f"and values itself")
        if decode_splits is not None and not cls.takes_splits(kernel):
            raise ValueError(f"decode_splits={decode_splits}: only flash-attn's split-KV decode (backend 'flash', "
                             f"decode_kernel 'flash') takes a split count")
        return dict(decode_kernel=kernel, decode_splits=decode_splits,
                    decode_append=cls.appends_decode_kv if decode_append is None else bool(decode_append),
                    dynamic=cls.default_dynamic(device_type) if dynamic is None else bool(dynamic))

    @classmethod
    def takes_splits(cls, kernel: str) -> bool:
        return False

    @classmethod
    def default_dynamic(cls, device_type: str) -> bool:
        """Whether the backend compiles dynamic shapes by default (only flex compiles; False elsewhere)."""
        return False

    @classmethod
    def why_unavailable(cls, device: torch.device, page_size: int | None = None,
                        decode_kernel: str | None = None) -> str | None:
        """None if the backend runs here (with this decode kernel), else the reason it cannot."""
        if page_size is not None and not cls.takes_page_size(page_size):
            return f"{cls.name} needs pages that are a multiple of {min(cls.page_sizes)} slots, got {page_size}"
        return None

    @classmethod
    def takes_page_size(cls, page_size: int) -> bool:
        return cls.page_sizes is None or page_size % min(cls.page_sizes) == 0

    def prepare(self, batch: AttnBatch, kind: str) -> None:
        """Per-step work shared by all layers (called once per step per kind: 'prefill' or 'decode')."""

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                scale: float) -> torch.Tensor:
        """q: [num_queries, heads, head_dim] packed chunk positions -> same shape."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
               scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
               rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [num_seqs, heads, head_dim], one row per request -> same shape. new_kv: the rows' own keys and values
        ([num_seqs, kv_heads, head_dim] each), not yet in the cache; given only where appends_decode_kv. rope:
        (cos, sin) [num_seqs, head_dim], given only with new_kv where rotates_decode: q and the new keys are then
        unrotated, and the kernel rotates them."""
        raise NotImplementedError

    def decode_into(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                    scale: float, out: torch.Tensor, is_decode: torch.Tensor, count: torch.Tensor) -> None:
        """A captured loaded step's decode call (engine/step_graphs.py): decode's rows written into `out` [rows,
        heads, head_dim] (the variable-length call's output over the same packed rows) where they are decode rows
        (`is_decode`, a [rows] bool mask: the first `count`, an int32 [1] device tensor); the others keep out's
        values. Here one merge kernel after decode; a kernel that can write only those rows itself overrides it."""
        torch.where(is_decode[:, None, None], self.decode(q, k_cache, v_cache, batch, scale), out, out=out)
