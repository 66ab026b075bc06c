"""Each gate's committed duration (pytest-split's files), and the order of xdist's work units it gives."""
from __future__ import annotations

import json
import os

# Each gate's seconds, as pytest-split stores them (`--store-durations`), per device kind: the CPU suite's in the
# root's .test_durations (the file pytest-split reads by default), the GPU suite's beside it.
DURATIONS_FILES = {"cpu": ".test_durations", "cuda": ".test_durations.cuda"}


def durations_file(rootdir, device: str) -> str:
    """The committed durations of the gates on `device` ("cuda:1" reads as "cuda")."""
    return os.path.join(str(rootdir), DURATIONS_FILES.get(device.split(":")[0], DURATIONS_FILES["cpu"]))


def read_durations(path: str) -> dict[str, float]:
    """pytest-split's durations file: {node id: seconds}; none (an empty dict) where it is missing or unreadable."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items()} if isinstance(data, dict) else {}


def longest_first(units: dict, seconds: dict[str, float]) -> list[str]:
    """The work units (name: its gates' node ids) ordered by their summed seconds, longest first (a gate not in
    `seconds` counts as the mean of those that are, or 1 s if none is); units of equal cost keep their order. Why: xdist hands each
    worker a unit, then the next as it frees up; started first, the longest unit is not the one that begins last and
    ends the run alone (the longest-processing-time-first rule)."""
    known = [seconds[n] for ids in units.values() for n in ids if n in seconds]
    default = sum(known) / len(known) if known else 1.0
    cost = {u: sum(seconds.get(n, default) for n in ids) for u, ids in units.items()}
    return sorted(units, key=lambda u: -cost[u])       # stable: ties keep the gates' own order
