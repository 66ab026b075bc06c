"""What every gate module agrees on and nothing else: the candidate engine configurations, and which files are gate
files. Below options, placement, workers and summary, so that they import it rather than each other."""
from __future__ import annotations

from pathlib import Path

# (engine configuration, attention backend): the candidates every comparison gate is parametrised over. A new
# backend joins here, so the token, poison and tiny-pool gates all cover it.
CANDIDATES = [("chunked", "torch"), ("fused", "torch"), ("fused", "flex"), ("flash", "flash")]


def is_gate_file(nodeid: str) -> bool:
    return Path(nodeid.split("::")[0]).parent.name == "gates"
