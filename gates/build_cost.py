"""The gate run's construction cost, from engine/build_cost.py's records: the engines the gates built and where their
build time went (compile of the elementwise pieces, the backend's warm-up, the captured steps' warm-up forwards and
their captures), printed after the gate summary. Under xdist each worker sends its sums to the controller."""
from __future__ import annotations

from engine import build_cost

KEY = "stepgate_build_cost"         # workeroutput: a worker's totals


def add(a: dict | None, b: dict) -> dict:
    return dict(b) if not a else {k: a.get(k, 0) + v for k, v in b.items()}


def line(t: dict) -> str:
    """One line: engines built, their seconds and where they went."""
    return (f"{t['engines']} engines built in {t['total_s']:.1f} s: compile {t['compile_s']:.1f} s, backend warm-up "
            f"{t['warmup_s']:.1f} s, captured steps {t['graph_warm_s'] + t['capture_s']:.1f} s ({t['graphs']} "
            f"graphs; warm-up forwards {t['graph_warm_s']:.1f} s, captures {t['capture_s']:.1f} s)")


def finish_worker(config) -> None:
    """On an xdist worker: its totals to the controller."""
    if hasattr(config, "workeroutput") and build_cost.BUILDS:
        config.workeroutput[KEY] = build_cost.totals()


def node_down(node) -> None:
    """On the controller: a worker's totals added to the run's."""
    t = getattr(node, "workeroutput", {}).get(KEY)
    if t:
        node.config.stash[_STASH] = add(node.config.stash.get(_STASH, None), t)


def report(config) -> str | None:
    """The run's line (this process's builds, or its workers'), None where no engine was built."""
    if hasattr(config, "workerinput"):
        return None
    t = config.stash.get(_STASH, None)
    if build_cost.BUILDS:
        t = add(t, build_cost.totals())
    return line(t) if t else None


import pytest  # noqa: E402

_STASH = pytest.StashKey[dict]()
