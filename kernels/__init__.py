"""Attention backends over the paged KV cache. `get_backend(name)` returns one; `why_unavailable` says why not."""
from __future__ import annotations

import torch

from .base import AttentionBackend, AttnBatch, KernelPath, Unavailable
from .flash_backend import FlashBackend
from .flex_backend import FlexBackend
from .torch_backend import TorchBackend

BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchBackend, "flex": FlexBackend, "flash": FlashBackend}


def declared_paths(names=None) -> list[KernelPath]:
    """The registry of kernel paths: every path each backend (`names`, default all) declares it can take. The kernel
    gate's cases come from here, and the coverage gate holds the paths a run took against it."""
    return [p for name, cls in BACKENDS.items() if names is None or name in names for p in cls.declared_paths()]


def backend_class(name: str) -> type[AttentionBackend]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise KeyError(f"unknown attention backend {name!r}; known: {sorted(BACKENDS)}") from None


def why_unavailable(name: str, device: torch.device | str, page_size: int | None = None,
                    decode_kernel: str | None = None) -> str | None:
    return backend_class(name).why_unavailable(torch.device(device), page_size, decode_kernel)


def get_backend(name: str, device: torch.device | str, page_size: int | None = None,
                **options) -> AttentionBackend:
    """A backend that runs here; `options`: the EngineConfig fields that pick its kernels (decode_kernel,
    decode_splits, decode_append, dynamic), None for their defaults."""
    reason = why_unavailable(name, device, page_size, options.get("decode_kernel"))
    if reason:
        raise Unavailable(f"attention backend {name!r} cannot run here: {reason}")
    return backend_class(name)(**options)


__all__ = ["AttentionBackend", "AttnBatch", "KernelPath", "Unavailable", "BACKENDS", "get_backend",
           "why_unavailable", "backend_class", "declared_paths"]
