"""The A/B decision: how sure we are that head's step is slower than base's, from timings taken in interleaved
rounds on one machine (gates/ab.py): a seeded bootstrap confidence interval of the ratio of medians.

Why this statistic: on a shared host the speed drifts from one second to the next (a neighbour's burst slows
everything for a while), and base's part of a round and head's part beside it see the same host. So each round gives
one paired ratio, median(head's steps) / median(base's steps) of that round; the estimate is the median of the
rounds' ratios (taken on their logarithms, so that 0.5x and 2x weigh alike), and its interval comes from resampling
whole rounds. Medians, not means: one descheduled step must not move the figure. (Pooling all rounds' steps before
taking medians read A/A runs of this 2-core host as far as 0.93x; the paired ratios of the same runs read 0.97-1.05x.)

Why two conditions for a regression: with enough rounds the interval gets tight around any systematic difference,
including the percent or two two processes of the SAME code can differ by (memory placement, a neighbour's load
during one process's steps). So a regression needs the interval above 1 (sure it is slower) AND the ratio above
1 + threshold (slower by more than A/A runs on this kind of device were): THRESHOLDS, from measured A/A noise
(docs/ab.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Per device kind: a head slower than base by less than this share is never called a regression, however sure the
# interval is. From A/A runs (docs/ab.md): CPU measured on a shared 2-core host; cuda provisional until
# scripts/h200_ab.sh's A/A runs on the H200 set it.
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
            resamples: int = RESAMPLES, seed: int = SEED) -> Comparison:
    """base[i], head[i]: the timings (seconds) of round i on each side. The ratio is the median over rounds of
    median(head[i]) / median(base[i]); the interval is the bootstrap's percentile interval of that median over
    resampled rounds. base_median / head_median: each side's median over all its steps, for the table."""
    b, h = _rounds(base, "base"), _rounds(head, "head")
    if len(b) != len(h):
        raise StatsError(f"paired rounds needed: base has {len(b)}, head {len(h)}")
    if not 0 < confidence < 1:
        raise StatsError(f"confidence must be in (0, 1), got {confidence}")
    n = len(b)
    logs = np.log(np.array([np.median(x) for x in h]) / np.array([np.median(x) for x in b]))
    rng = np.random.default_rng(seed)
    boot = np.median(logs[rng.integers(0, n, size=(resamples, n))], axis=1)
    alpha = (1.0 - confidence) / 2
    low, high = (float(np.exp(x)) for x in np.quantile(boot, [alpha, 1.0 - alpha]))
    ratio = float(np.exp(np.median(logs)))
    return Comparison(float(np.median(np.concatenate(b))), float(np.median(np.concatenate(h))), ratio, low, high,
                      confidence, threshold, n, verdict(ratio, low, high, threshold))
