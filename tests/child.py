"""The environment of a child process that a test starts (a gate CLI, a pytest-benchmark run): this one's, less
xdist's worker variables. Under `pytest tests/ -n N` a child inherits PYTEST_XDIST_WORKER, and pytest-benchmark,
reading it, turns itself off in the child's own serial run ("xdist plugin is active"): the refresh-baseline and
planted-slowdown tests then found no benchmark saved and failed under -n alone."""
from __future__ import annotations

import os


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(extra)
    return env
