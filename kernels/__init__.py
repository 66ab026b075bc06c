"""Attention backends over the paged KV cache. `get_backend(name)` returns one; `why_unavailable` says why not."""
from __future__ import annotations

import torch

from .base import AttentionBackend, AttnBatch, Unavailable
from .flash_backend import FlashBackend
from .flex_backend import FlexBackend
from .torch_backend import TorchBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchBackend, "flex": FlexBackend, "flash": FlashBackend}


def backend_class(name: str) -> type[AttentionBackend]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}") from None


def why_unavailable(name: str, device: torch.device | str, page_size: int | None = None) -> str | None:
    return backend_class(name).why_unavailable(torch.device(device), page_size)


def get_backend(name: str, device: torch.device | str, page_size: int | None = None) -> AttentionBackend:
    reason = why_unavailable(name, device, page_size)
    if reason:
        raise Unavailable(f"attention backend {name!r} cannot run here: {reason}")
    return backend_class(name)()


__all__ = ["AttentionBackend", "AttnBatch", "Unavailable", "BACKENDS", "get_backend", "why_unavailable",
           "backend_class"]
