"""Where golden/ (goldens, benchmark history) is: in the checkout the package runs from; for an installed stepgate
(`pip install .`, the console scripts), in the working directory. Imports nothing heavy: gates.alert needs no torch."""
from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent


def golden_root() -> Path:
    here = CHECKOUT / "golden"
    return here if here.is_dir() else Path.cwd() / "golden"
