"""The dtype names the engine, the gates and the CLIs accept: one table, names only until torch is needed."""
from __future__ import annotations

# accepted name -> canonical name (torch's: goldens and configs are keyed by it)
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
               "bfloat16": "bfloat16", "bf16": "bfloat16"}


def canonical_dtype(name) -> str:
    """'fp16' -> 'float16'; a torch dtype of the table -> its name. Anything else: ValueError naming the known."""
    key = str(name).removeprefix("torch.") if type(name).__module__ == "torch" else name
    try:
        return DTYPE_NAMES[key]
    except (KeyError, TypeError):
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPE_NAMES)}") from None


def torch_dtype(name):
    """The torch dtype of a name of the table (or of a torch dtype of the table)."""
    import torch
    return getattr(torch, canonical_dtype(name))
