"""Where building engines takes its time, in this process: each engine built appends one record (the elementwise
pieces' compile, the backend's warm-up, the captured steps' warm-up forwards and captures, the graphs), so a run of
many engines (the gate suite) can say what its construction cost and where (gates/build_cost.py prints it)."""
from __future__ import annotations

import time
from contextlib import contextmanager

BUILDS: list[dict] = []
PARTS = ("compile_s", "warmup_s", "graph_warm_s", "capture_s")


def record(config_key: str, parts: dict[str, float], total_s: float) -> dict:
    """One engine's build: `parts` (seconds, PARTS' names; "graphs": its captured graphs) and its whole
    construction."""
    entry = dict(config=config_key, graphs=int(parts.get("graphs", 0)), total_s=total_s,
                 **{k: parts.get(k, 0.0) for k in PARTS})
    BUILDS.append(entry)
    return entry


def totals(builds: list[dict] | None = None) -> dict:
    """The builds summed: engines, graphs, seconds by part and in all."""
    builds = BUILDS if builds is None else builds
    out = dict(engines=len(builds), graphs=sum(b["graphs"] for b in builds),
               total_s=sum(b["total_s"] for b in builds))
    out.update({k: sum(b[k] for b in builds) for k in PARTS})
    return out


def add_graph_sets(parts: dict[str, float], graph_sets) -> None:
    """A build's captured steps into `parts`: each set's graphs, its warm-up forwards, and the rest of its capture
    time (a set times both together; None: a set not built)."""
    for g in graph_sets:
        if g is not None:
            parts["graphs"] = parts.get("graphs", 0) + len(g.graphs)
            parts["graph_warm_s"] = parts.get("graph_warm_s", 0.0) + g.warm_s
            parts["capture_s"] = parts.get("capture_s", 0.0) + g.capture_s - g.warm_s


@contextmanager
def timed(parts: dict[str, float], name: str):
    """Add the block's wall time to parts[name]."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        parts[name] = parts.get(name, 0.0) + time.perf_counter() - t0
