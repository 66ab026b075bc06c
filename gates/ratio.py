"""Ratio gates: two callables timed interleaved on one state, and the check that one is cheaper than the other.

The ratio is the median over repetitions of fast / slow timed back to back: a burst of load from other processes
lands on both halves of a pair, where a ratio of the two medians takes them from different moments. On a CPU the
pair runs on one torch thread: with two, a step waits on a sibling thread the OS descheduled, and the times of one
step spread 5 to 100x on a loaded 2-core machine (the fused/chunked gate failed at 1.048 there; on one thread, the
pair ratio stayed within 0.81 to 0.90 at a load of 6 on 2 cores)."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch

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
    ratio: float            # the median of the repetitions' fast / slow

    def __str__(self) -> str:
        return (f"{self.fast_name}: median {self.fast_median * 1e3:.3f} ms; {self.slow_name}: median "
                f"{self.slow_median * 1e3:.3f} ms; ratio {self.ratio:.3f} (median of {self.reps} back-to-back "
                f"pairs)")


@contextlib.contextmanager
def one_thread_on_cpu(cpu: bool):
    """torch's intra-op threads set to 1 for the block when `cpu` (see the module docstring), restored after."""
    n = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def measure_pair(fast, slow, reps: int = 15, warmup: int = 2, sync=None) -> tuple[list[float], list[float]]:
    """Seconds of each repetition of two callables timed interleaved on the same state (ABBA order, so a drift in
    the machine's speed lands on both), pair by pair."""
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
    return tf, ts


def check_faster(fast_name: str, fast, slow_name: str, slow, reps: int = 15, warmup: int = 2, sync=None,
                 max_ratio: float = 1.0) -> Ratio:
    """Check that `fast` is cheaper than `slow`: the median of fast / slow over back-to-back pairs is under
    `max_ratio`, measured interleaved in one run. The failure message gives both medians and the ratio."""
    tf, ts = measure_pair(fast, slow, reps, warmup, sync)
    ratio = statistics.median(a / b if b > 0 else float("inf") for a, b in zip(tf, ts))
    r = Ratio(fast_name, slow_name, statistics.median(tf), statistics.median(ts), reps, ratio)
    if not r.ratio < max_ratio:
        raise GateFailure(f"ratio gate: {fast_name} is not cheaper than {slow_name} (want ratio < {max_ratio:g}): {r}")
    return r


def fused_vs_chunked(st: FixedState, reps: int, warmup: int = 2, plant=None) -> Ratio:
    """The ratio gate: a fused loaded step against the two chunked forwards it replaces, on the same state.
    `plant` wraps the fused step (tests only)."""
    fused = st.step_fn(StepKind.LOADED, "fused")
    if plant is not None:
        fused = plant(fused)
    chunked = st.step_fn(StepKind.LOADED, "chunked")
    with one_thread_on_cpu(torch.device(st.device).type == "cpu"):
        return check_faster("fused loaded step (one forward)", fused, "chunked loaded step (two forwards)", chunked,
                            reps=reps, warmup=warmup, sync=st.sync)
