"""Attention backends over the paged KV cache. `get_backend(name)` returns one; `why_unavailable` says why not.

The backends (and torch) are imported at the first use of a name that needs them, not with the package: importing
kernels.errors or kernels.envs alone, as the engine's bookkeeping does, imports no torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from .base import AttentionBackend, KernelPath

_IN_BASE = ("AttentionBackend", "AttnBatch", "KernelPath", "Unavailable")


def _backends() -> dict:
    """The registry, made once (tests and plants add to the same dict)."""
    if "BACKENDS" not in globals():
        from .flash_backend import FlashBackend
        from .flex_backend import FlexBackend
        from .torch_backend import TorchBackend
        globals()["BACKENDS"] = {"torch": TorchBackend, "flex": FlexBackend, "flash": FlashBackend}
    return globals()["BACKENDS"]


def __getattr__(name: str):
    """The backend registry and the base classes, imported when first asked for."""
    if name in _IN_BASE:
        return getattr(importlib.import_module(".base", __name__), name)
    if name == "BACKENDS":
        return _backends()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def declared_paths(names=None) -> list[KernelPath]:
    """The registry of kernel paths: every path each backend (`names`, default all) declares it can take. The kernel
    gate's cases come from here, and the coverage gate holds the paths a run took against it."""
    return [p for name, cls in _backends().items() if names is None or name in names
            for p in cls.declared_paths()]


def backend_class(name: str) -> type[AttentionBackend]:
    backends = _backends()
    try:
        return backends[name]
    except KeyError:
        raise KeyError(f"unknown attention backend {name!r}; known: {sorted(backends)}") from None


def why_unavailable(name: str, device: torch.device | str, page_size: int | None = None,
                    decode_kernel: str | None = None) -> str | None:
    import torch
    return backend_class(name).why_unavailable(torch.device(device), page_size, decode_kernel)


def get_backend(name: str, device: torch.device | str, page_size: int | None = None,
                **options) -> AttentionBackend:
    """A backend that runs here; `options`: the EngineConfig fields that pick its kernels (decode_kernel,
    decode_splits, decode_append, dynamic), None for their defaults."""
    reason = why_unavailable(name, device, page_size, options.get("decode_kernel"))
    if reason:
        from .base import Unavailable
        raise Unavailable(f"attention backend {name!r} cannot run here: {reason}")
    return backend_class(name)(**options)


__all__ = ["AttentionBackend", "AttnBatch", "KernelPath", "Unavailable", "BACKENDS", "get_backend",
           "why_unavailable", "backend_class", "declared_paths"]
