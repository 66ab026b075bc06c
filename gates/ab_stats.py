"""The A/B decision: how sure we are that head's step is slower than base's, from timings taken in interleaved
rounds on one machine by one or more pairs of processes (gates/ab.py): a seeded hierarchical bootstrap confidence
interval of the ratio of medians.

Why this statistic: on a shared host the speed drifts from one second to the next (a neighbour's burst slows
everything for a while), and base's part of a round and head's part beside it see the same host. So each round gives
one paired ratio, median(head's steps) / median(base's steps) of that round. Medians, not means: one descheduled step
must not move the figure. (Pooling all rounds' steps before taking medians read A/A runs of this 2-core host as far
as 0.93x; the paired ratios of the same runs read 0.97-1.05x.)

Why the process pair is the unit: a process has a speed of its own that no number of rounds averages out (on the
H200 one process of the same code sat at 2.64-2.69 ms a step for 100 rounds while its partner read 2.35-2.58 ms;
docs/ab.md). So each pair of processes gives one ratio, the median of its rounds' ratios (on their logarithms, so
that 0.5x and 2x weigh alike); the estimate is the mean of the pairs' ratios (geometric), and its interval comes from
resampling pairs, then rounds within each drawn pair. With one pair this is the bootstrap over rounds; with two or
three it reaches from about the lowest pair's ratio to the highest: pairs that disagree give a wide interval.

Why two conditions for a regression: with enough rounds the interval gets tight around any systematic difference,
including the percent or two two processes of the SAME code can differ by. So a regression needs the interval above
1 (sure it is slower) AND the ratio above 1 + threshold (slower by more than A/A runs on this kind of device were):
THRESHOLDS, from measured A/A noise (docs/ab.md). With few pairs the threshold carries most of the guard against a
false alarm: every one of three A/A pairs reads above 1 one time in eight.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Per device kind: a head slower than base by less than this share is never called a regression, however sure the
# interval is. From A/A runs (docs/ab.md): CPU measured on a shared 2-core host, one process pair a run. cuda: the
# H200, three pairs a run: A/A estimates 0.962-1.008x over seven runs (none above 1.008x), a 5% plant 1.043-1.062x
# over five (intervals' low ends 1.028 and up): 3% sits between them; five pairs a run (gates/ab.py's default on
# cuda) narrow both spreads.
THRESHOLDS = {"cpu": 0.05, "cuda": 0.03}
CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0

REGRESSION, IMPROVED, OK = "REGRESSION", "improved", "ok"


class StatsError(ValueError):
    pass


@dataclass(frozen=True)
class Comparison:
    base_median: float          # seconds, all rounds pooled
    head_median: float
    ratio: float                # head / base: above 1 is slower
    low: float                  # the ratio's confidence interval
    high: float
    confidence: float
    threshold: float
    rounds: int
    verdict: str
    pairs: tuple[float, ...] = ()    # each process pair's ratio, in the order the pairs were numbered

    def interval(self) -> str:
        return f"{self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}]"


def threshold_for(device: str) -> float:
    kind = str(device).split(":")[0]
    if kind not in THRESHOLDS:
        raise StatsError(f"no A/B threshold for device kind {kind!r} (known: {sorted(THRESHOLDS)}); pass one")
    return THRESHOLDS[kind]


def _rounds(rounds: list[list[float]], side: str) -> list[np.ndarray]:
    out = [np.asarray(r, dtype=float) for r in rounds]
    if not out or any(r.size == 0 for r in out):
        raise StatsError(f"{side}: every round needs at least one timing ({[r.size for r in out]} per round)")
    if any(not np.all(np.isfinite(r)) or np.any(r <= 0) for r in out):
        raise StatsError(f"{side}: timings must be positive and finite")
    return out


def verdict(ratio: float, low: float, high: float, threshold: float) -> str:
    if low > 1.0 and ratio > 1.0 + threshold:
        return REGRESSION
    if high < 1.0 and ratio < 1.0 / (1.0 + threshold):
        return IMPROVED
    return OK


def compare(base: list[list[float]], head: list[list[float]], threshold: float, confidence: float = CONFIDENCE,
            resamples: int = RESAMPLES, seed: int = SEED, pairs: list[int] | None = None) -> Comparison:
    """base[i], head[i]: the timings (seconds) of round i on each side; pairs[i]: the process pair that timed round
    i (default: one pair timed them all). The ratio is the geometric mean over pairs of each pair's median over its
    rounds of median(head[i]) / median(base[i]); the interval is the bootstrap's percentile interval of that mean
    over resampled pairs, and rounds resampled within each drawn pair. base_median / head_median: each side's median
    over all its steps, for the table."""
    b, h = _rounds(base, "base"), _rounds(head, "head")
    if len(b) != len(h):
        raise StatsError(f"paired rounds needed: base has {len(b)}, head {len(h)}")
    if not 0 < confidence < 1:
        raise StatsError(f"confidence must be in (0, 1), got {confidence}")
    pairs = [0] * len(b) if pairs is None else list(pairs)
    if len(pairs) != len(b):
        raise StatsError(f"a pair for every round needed: {len(b)} rounds, {len(pairs)} pairs given")
    logs = np.log(np.array([np.median(x) for x in h]) / np.array([np.median(x) for x in b]))
    ids = sorted(set(pairs))
    groups = [logs[np.array(pairs) == p] for p in ids]          # each pair's rounds' log ratios
    n = len(groups)
    rng = np.random.default_rng(seed)
    # within[p, k]: pair p's median over a resample of its own rounds, resamples x n of them, so that a pair drawn
    # twice into one bootstrap replicate brings two independent resamples of its rounds
    within = np.stack([np.median(g[rng.integers(0, g.size, size=(resamples * n, g.size))], axis=1) for g in groups])
    drawn = rng.integers(0, n, size=(resamples, n))             # the pairs of each replicate
    boot = within[drawn, np.arange(resamples * n).reshape(resamples, n)].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = (float(np.exp(x)) for x in np.quantile(boot, [alpha, 1.0 - alpha]))
    pair_logs = np.array([np.median(g) for g in groups])
    ratio = float(np.exp(pair_logs.mean()))
    return Comparison(float(np.median(np.concatenate(b))), float(np.median(np.concatenate(h))), ratio, low, high,
                      confidence, threshold, len(b), verdict(ratio, low, high, threshold),
                      tuple(float(x) for x in np.exp(pair_logs)))
