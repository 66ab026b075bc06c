"""The coverage gate: every kernel path the gates' engines took (the runner's path census, engine/census.py) was
checked by the kernel gate against fp32 attention on a cache rebuilt from the pages, and every path a backend
declares (kernels.declared_paths, the registry the kernel gate's cases come from) ran. A path taken that no check
covered, or a declared path that nothing ran, fails the run, naming the path: a new kernel, an append or a split is
then gated by construction, not by someone remembering to add a case.

Gates record what they ran here (`served`, `checked`); the records travel in the test reports' user_properties to
the process that summarises the run (gates/summary.py), so a run over xdist workers is judged as a whole."""
from __future__ import annotations

from engine.census import merge

SERVED_KEY = "stepgate-census"      # user property: one engine run's census rows and its served configuration
CHECKED_KEY = "stepgate-checked"    # user property: a kernel path the kernel gate checked and passed
PENDING: list[tuple[str, object]] = []


def served(label: str, engine) -> None:
    """Record an engine run's path census (after the run)."""
    PENDING.append((SERVED_KEY, {"label": label, "served": engine.served.key(), "rows": engine.runner.path_census()}))


def checked(path) -> None:
    """Record that the kernel gate checked `path` (a KernelPath) and it passed."""
    PENDING.append((CHECKED_KEY, path.name))


def kernel_steps(census: dict) -> dict[str, int]:
    """Steps per kernel path, from a merged census (engine.census.merge's keys)."""
    out: dict[str, int] = {}
    for key, steps in census.items():
        for name in dict(key)["kernels"]:
            out[name] = out.get(name, 0) + steps
    return out


def problems(census: dict, checked_paths: dict[str, int], declared: list[str]) -> list[str]:
    """The coverage gate's failures, one line a path: taken but never checked; declared but never run. `declared`:
    the registry's paths of the backends the kernel gate ran here (a backend that cannot run here declares
    nothing to this run)."""
    taken = kernel_steps(census)
    out = [f"{p}: taken in {n} steps by the gates' engines, never checked by the kernel gate against fp32 on a "
           f"rebuilt cache" for p, n in sorted(taken.items()) if p not in checked_paths]
    out += [f"{p}: declared by its backend (kernels.declared_paths), never ran: neither an engine nor the kernel "
            f"gate took it" for p in declared if p not in checked_paths and p not in taken]
    return out


def declared_here(checked_paths: dict[str, int], backends) -> list[str]:
    """The registry's paths of the selected backends that the kernel gate ran at least one path of."""
    import kernels
    ran = {name.split(".")[0] for name in checked_paths}
    return [p.name for p in kernels.declared_paths([b for b in backends if b in ran])]


def census_table(census: dict, shown: int = 6) -> list[tuple]:
    """Rows (kind, kernels, mode, buckets, ahead, prefix hit, steps), most steps first; a row's captured buckets
    (rows x table width, or tokens x width) listed, most used first."""
    groups: dict[tuple, dict[str, int]] = {}
    for key, steps in census.items():
        k = dict(key)
        g = groups.setdefault((k["kind"], " + ".join(k["kernels"]), k["mode"], k["ahead"], k["prefix_hit"]), {})
        g[k["bucket"]] = g.get(k["bucket"], 0) + steps
    rows = []
    for (kind, kernels_, mode, ahead, hit), buckets in groups.items():
        names = sorted(buckets, key=lambda b: -buckets[b])
        listed = ", ".join(names[:shown]) + (f" (+{len(names) - shown})" if len(names) > shown else "")
        rows.append((kind, kernels_, mode, listed, ahead, hit, sum(buckets.values())))
    return sorted(rows, key=lambda r: (-r[-1], r[:-1]))


__all__ = ["CHECKED_KEY", "SERVED_KEY", "census_table", "checked", "declared_here", "kernel_steps", "merge",
           "problems", "served"]
