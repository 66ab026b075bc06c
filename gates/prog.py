"""The name a command line's usage line shows: the console script it was started as (`stepgate-bench`), or
`python -m MODULE` when it runs as a module (pyproject.toml's [project.scripts] names every script)."""
from __future__ import annotations

import os
import sys

SCRIPT_PREFIX = "stepgate-"


def prog(module: str) -> str:
    name = os.path.basename(sys.argv[0])
    return name if name.startswith(SCRIPT_PREFIX) else f"python -m {module}"
