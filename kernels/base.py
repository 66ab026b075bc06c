"""The attention backend interface: prefill over packed chunk positions and decode with one query row per request,
both over the same paged cache. Per-layer cache tensors have flash-attn's paged layout
[num_pages, page_size, kv_heads, head_dim]."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stepgate_errors import ConfigError


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
    # True when decode takes the step's new keys and values (new_kv) and writes them itself, at each row's last
    # position (kv_lens - 1), before it attends: a pure decode step then launches no separate cache writes
    appends_decode_kv: bool = False

    @classmethod
    def why_unavailable(cls, device: torch.device, page_size: int | None = None) -> str | None:
        """None if the backend runs here, else the reason it cannot."""
        if page_size is not None and cls.page_sizes is not None and page_size % min(cls.page_sizes) != 0:
            return f"{cls.name} needs pages that are a multiple of {min(cls.page_sizes)} slots, got {page_size}"
        return None

    def prepare(self, batch: AttnBatch, kind: str) -> None:
        """Per-step work shared by all layers (called once per step per kind: 'prefill' or 'decode')."""

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
                scale: float) -> torch.Tensor:
        """q: [num_queries, heads, head_dim] packed chunk positions -> same shape."""
        raise NotImplementedError

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttnBatch,
               scale: float, new_kv: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """q: [num_seqs, heads, head_dim], one row per request -> same shape. new_kv: the rows' own keys and values
        ([num_seqs, kv_heads, head_dim] each), not yet in the cache; given only where appends_decode_kv."""
        raise NotImplementedError
