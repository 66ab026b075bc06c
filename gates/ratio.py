"""Ratio gates: two callables timed interleaved on one state, and the check that one is cheaper than the other."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from engine.scheduler import StepKind

from .failure import GateFailure
from .step_states import FixedState


@dataclass
class Ratio:
    fast_name: str
    slow_name: str
    fast_median: float      # seconds
    slow_median: float
    reps: int

    @property
    def ratio(self) -> float:
        return self.fast_median / self.slow_median if self.slow_median > 0 else float("inf")

    def __str__(self) -> str:
        return (f"{self.fast_name}: median {self.fast_median * 1e3:.3f} ms; {self.slow_name}: median "
                f"{self.slow_median * 1e3:.3f} ms; ratio {self.ratio:.3f} over {self.reps} interleaved repetitions")


def measure_pair(fast, slow, reps: int = 15, warmup: int = 2, sync=None) -> tuple[float, float]:
    """Medians (seconds) of two callables timed interleaved on the same state (ABBA order, so a drift in the
    machine's speed lands on both)."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fast()
        slow()
    tf, ts = [], []

    def timed(fn, into):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        into.append(time.perf_counter() - t)
    for i in range(reps):
        if i % 2 == 0:
            timed(fast, tf)
            timed(slow, ts)
        else:
            timed(slow, ts)
            timed(fast, tf)
    return statistics.median(tf), statistics.median(ts)


def check_faster(fast_name: str, fast, slow_name: str, slow, reps: int = 15, warmup: int = 2, sync=None,
                 max_ratio: float = 1.0) -> Ratio:
    """Check that `fast` is cheaper than `slow` (median(fast) < max_ratio * median(slow)), measured interleaved in
    one run. Returns both medians; the failure message gives both."""
    f, s = measure_pair(fast, slow, reps, warmup, sync)
    r = Ratio(fast_name, slow_name, f, s, reps)
    if not f < max_ratio * s:
        raise GateFailure(f"ratio gate: {fast_name} is not cheaper than {slow_name} (want ratio < {max_ratio:g}): {r}")
    return r


def fused_vs_chunked(st: FixedState, reps: int, warmup: int = 2, plant=None) -> Ratio:
    """The ratio gate: a fused loaded step against the two chunked forwards it replaces, on the same state.
    `plant` wraps the fused step (tests only)."""
    fused = st.step_fn(StepKind.LOADED, "fused")
    if plant is not None:
        fused = plant(fused)
    chunked = st.step_fn(StepKind.LOADED, "chunked")
    return check_faster("fused loaded step (one forward)", fused, "chunked loaded step (two forwards)", chunked,
                        reps=reps, warmup=warmup, sync=st.sync)
