"""ConfigError, the one error every layer shares: it lives here, at the bottom, and imports nothing (no torch), so
that engine's bookkeeping (engine/errors.py, engine/pool.py) can raise it without importing torch, and a backend
that cannot run (kernels.Unavailable) can be one: a configuration the engine cannot serve with."""


class ConfigError(ValueError):
    """An EngineConfig field (or the pool it makes with the model) that the engine cannot serve with: the message
    names the field and its value."""
