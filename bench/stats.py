"""The helpers every benchmark shares: log lines beside progress bars, number formatting, comma-separated lists,
medians and quantiles that skip missing values, CSV rows, kernel timing inside a CUDA graph."""
from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


def log(msg: str, file=None) -> None:
    """One line to stdout (or `file`), written around any progress bar."""
    file = file or sys.stdout
    if tqdm is not None:
        tqdm.write(msg, file=file)
    else:
        print(msg, file=file, flush=True)


class _NoBar:
    n = 0

    def update(self, n=1): pass
    def close(self): pass
    def set_postfix_str(self, s): pass


def progress(total=None, desc="", leave=False, disable=False, **kw):
    """A tqdm bar on stderr, or one that does nothing (disabled, or tqdm missing)."""
    if tqdm is None or disable:
        return _NoBar()
    return tqdm(total=total, desc=desc, leave=leave, dynamic_ncols=True, file=sys.stderr, **kw)


def fmt(x, nd: int = 2, none: str = "-") -> str:
    """A float to `nd` places, a bool as yes/no, None as `none`, anything else as str."""
    if x is None:
        return none
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def ints(s: str | None) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()] if s else []


def floats(s: str | None) -> list[float]:
    """In the order given."""
    return [float(x) for x in s.split(",") if x.strip()] if s else []


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def quantile(xs, q: float):
    """The nearest-rank q-quantile of the values that are not None."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def gaps(times: list[float]) -> list[float]:
    """Waits between consecutive times."""
    return [b - a for a, b in zip(times, times[1:])]


def write_csv(path: Path, fields: list[str], rows: list[dict], append: bool = False, digits: int | None = None):
    """Rows to `path` (a header unless appending to an existing file); floats rounded to `digits` when given."""
    new = not (append and Path(path).exists())
    with open(path, "w" if new else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow(r if digits is None else {k: (round(v, digits) if isinstance(v, float) else v)
                                                 for k, v in r.items()})


def capture(step):
    """(`step` captured in a CUDA graph, its output tensor). Warmed up once on a side stream, as capture needs."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def graph_time(step, reps: int, per: int = 1):
    """(median microseconds per `per` over `reps` replays of `step` captured in a CUDA graph (`capture`), the
    step's output as float). CUDA events around each replay."""
    import torch
    graph, out = capture(step)
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / per)
    return statistics.median(times), out.float().clone()
