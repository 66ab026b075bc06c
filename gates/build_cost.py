"""The gate run's construction cost, from engine/build_cost.py's records: the engines the gates built and where their
build time went (compile of the elementwise pieces, the backend's warm-up, the captured steps' warm-up forwards and
their captures), printed after the gate summary; and what the candidate runs (gates/runs.py: every configuration's
memoised run of a workload) cost, by configuration, so that a slow suite says which engines' steps it waited on.
Under xdist each worker sends its sums to the controller."""
from __future__ import annotations

from engine import build_cost

KEY = "stepgate_build_cost"         # workeroutput: a worker's totals
RUNS_KEY = "stepgate_run_cost"
CONFIGS_KEY = "stepgate_build_configs"
# configuration (engine[backend]) -> [runs, steps, seconds]: this process's candidate runs
RUNS: dict[str, list] = {}


def record_run(config: str, steps: int, seconds: float) -> None:
    r = RUNS.setdefault(config, [0, 0, 0.0])
    r[0], r[1], r[2] = r[0] + 1, r[1] + steps, r[2] + seconds


def add_runs(a: dict, b: dict) -> dict:
    out = {k: list(v) for k, v in a.items()}
    for k, v in b.items():
        out[k] = [x + y for x, y in zip(out.get(k, [0, 0, 0.0]), v)]
    return out


def runs_line(runs: dict) -> str:
    """One line: the candidate runs' seconds, by configuration, slowest first, with their steps' mean."""
    each = sorted(runs.items(), key=lambda kv: -kv[1][2])
    return (f"candidate runs took {sum(v[2] for v in runs.values()):.1f} s: " + "; ".join(
        f"{k} {s:.1f} s ({n} run{'' if n == 1 else 's'}, {steps} steps, {1e3 * s / max(1, steps):.2f} ms a step)"
        for k, (n, steps, s) in each))


def add(a: dict | None, b: dict) -> dict:
    return dict(b) if not a else {k: a.get(k, 0) + v for k, v in b.items()}


def line(t: dict) -> str:
    """One line: engines built, their seconds and where they went."""
    return (f"{t['engines']} engines built in {t['total_s']:.1f} s: compile {t['compile_s']:.1f} s, backend warm-up "
            f"{t['warmup_s']:.1f} s, captured steps {t['graph_warm_s'] + t['capture_s']:.1f} s ({t['graphs']} "
            f"graphs; warm-up forwards {t['graph_warm_s']:.1f} s, captures {t['capture_s']:.1f} s)")


def by_config(builds: list[dict]) -> dict:
    """configuration key -> [engines built, their seconds, their graphs]: which configurations' builds the run paid
    for, and how often (the same configuration built again is what sharing engines between gates would save)."""
    out: dict[str, list] = {}
    for b in builds:
        r = out.setdefault(b["config"], [0, 0.0, 0])
        r[0], r[1], r[2] = r[0] + 1, r[1] + b["total_s"], r[2] + b["graphs"]
    return out


def configs_line(configs: dict, top: int = 6) -> str:
    """One line: the configurations whose builds took longest, with how many of each were built."""
    each = sorted(configs.items(), key=lambda kv: -kv[1][1])
    return (f"engine builds by configuration ({len(configs)} configurations; the {min(top, len(each))} slowest): "
            + "; ".join(f"{k} {n}x {s:.1f} s ({int(g)} graphs)" for k, (n, s, g) in each[:top]))


def finish_worker(config) -> None:
    """On an xdist worker: its totals to the controller."""
    if hasattr(config, "workeroutput") and build_cost.BUILDS:
        config.workeroutput[KEY] = build_cost.totals()
        config.workeroutput[CONFIGS_KEY] = by_config(build_cost.BUILDS)
    if hasattr(config, "workeroutput") and RUNS:
        config.workeroutput[RUNS_KEY] = RUNS


def node_down(node) -> None:
    """On the controller: a worker's totals added to the run's."""
    t = getattr(node, "workeroutput", {}).get(KEY)
    if t:
        node.config.stash[_STASH] = add(node.config.stash.get(_STASH, None), t)
    r = getattr(node, "workeroutput", {}).get(RUNS_KEY)
    if r:
        node.config.stash[_RUNS] = add_runs(node.config.stash.get(_RUNS, {}), r)
    c = getattr(node, "workeroutput", {}).get(CONFIGS_KEY)
    if c:
        node.config.stash[_CONFIGS] = add_runs(node.config.stash.get(_CONFIGS, {}), c)


def report(config) -> list[str]:
    """The run's lines (this process's builds and runs, or its workers'); none where no engine was built."""
    if hasattr(config, "workerinput"):
        return []
    t = config.stash.get(_STASH, None)
    if build_cost.BUILDS:
        t = add(t, build_cost.totals())
    runs = add_runs(config.stash.get(_RUNS, {}), RUNS)
    configs = add_runs(config.stash.get(_CONFIGS, {}), by_config(build_cost.BUILDS))
    return ([line(t)] if t else []) + ([configs_line(configs)] if configs else []) + (
        [runs_line(runs)] if runs else [])


import pytest  # noqa: E402

_STASH = pytest.StashKey[dict]()
_RUNS = pytest.StashKey[dict]()
_CONFIGS = pytest.StashKey[dict]()
