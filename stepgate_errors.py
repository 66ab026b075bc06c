"""The one error shared by every layer: ConfigError. It lives here, below engine/ and kernels/ and importing nothing,
because a backend that cannot run (kernels.Unavailable) is a configuration the engine cannot serve with, kernels must
not import engine, and engine's bookkeeping (engine/errors.py, engine/pool.py) must not import torch, which
importing anything under kernels/ does."""


class ConfigError(ValueError):
    """An EngineConfig field (or the pool it makes with the model) that the engine cannot serve with: the message
    names the field and its value."""
