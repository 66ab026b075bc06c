"""One folder for torch's compile caches, so that CI can keep it between runs: STEPGATE_COMPILE_CACHE=DIR.

Inductor keeps everything a later process can reuse under its cache folder: the FX graph cache (compiled C++ or
Triton code), the AOTAutograd cache, Triton's kernels and dynamo's dynamic-shape profile. Pointing that folder
(TORCHINDUCTOR_CACHE_DIR) at DIR is all it takes; a process whose graphs are all in DIR compiles nothing (dynamo
still traces). Inductor's precompiled C++ header stays in the temp dir, but it is only used on a miss.

Kernels written in Triton directly (kernels/triton_decode.py) are cached by Triton itself, under TRITON_CACHE_DIR
(else ~/.triton/cache, which CI does not keep): that is pointed at DIR/triton-jit.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import envs

ENV = "STEPGATE_COMPILE_CACHE"


def use_compile_cache(path: str | os.PathLike | None = None) -> str | None:
    """Point torch's compile caches at `path` (default: $STEPGATE_COMPILE_CACHE), creating it; it overrides
    TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (PATH/triton-jit). Call it before the first compile
    (kernels.flex_backend does, at its first compile; kernels.triton_decode before its first launch).
    Returns the folder, or None (caches left where they are) when neither is given."""
    path = path if path is not None else envs.get(ENV)
    if not path:
        return None
    folder = Path(path).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{ENV}={path}: {folder} exists and is not a directory")
    folder.mkdir(parents=True, exist_ok=True)
    envs.set_process("TORCHINDUCTOR_CACHE_DIR", str(folder))
    envs.set_process("TRITON_CACHE_DIR", str(folder / "triton-jit"))   # Triton reads it at each compile
    return str(folder)


__all__ = ["ENV", "use_compile_cache"]
