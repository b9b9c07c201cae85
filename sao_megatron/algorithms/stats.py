"""Confidence intervals and run summaries used by evaluation and the study (pure Python + scipy).

- pass@1 (a proportion): Wilson score interval (Wilson 1927), which stays inside [0, 1] and is
  sensible at 0 or n successes, unlike the normal approximation.
- a mean (mean reward, a metric over seeds): Student-t interval, mean ± t_{n-1, (1+c)/2} · s/√n.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def _z(confidence: float) -> float:
    from scipy.stats import norm

    return float(norm.ppf(0.5 + confidence / 2))


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``successes / n``; (0, 1) when ``n`` is 0."""
    if not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    z = _z(confidence)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student-t interval of the mean; low = high = mean for fewer than 2 values."""
    from scipy.stats import t

    n = len(values)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(values) / n
    if n < 2:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def steps_to_threshold(steps: Sequence[int], values: Sequence[float], threshold: float,
                       window: int = 5) -> int | None:
    """First step at which the trailing ``window``-point mean of ``values`` reaches ``threshold``."""
    return next((int(s) for s, m in zip(steps, trailing_mean(values, window)) if m >= threshold), None)


def trailing_mean(values: Sequence[float], window: int) -> list[float]:
    """Point i: the mean of values[i - window + 1 .. i] (fewer at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def adaptation_steps(steps: Sequence[int], values: Sequence[float], phases: Sequence[int], *,
                     recover: float = 0.9, window: int = 5) -> list[int | None]:
    """Per phase change: steps until the trailing mean recovers ``recover`` x the level to recover.

    ``phases[i]`` is the phase of point i. A phase ends at the mean of its last ``window`` points; the
    level to recover after a change is the highest level any phase before it ended at. So a shift back
    to a target the run had learnt must climb back to where it was, not to the level of an intervening
    phase it never learnt (which it would "recover" at once). None when a phase never recovers.
    """
    out: list[int | None] = []
    ended: list[float] = []
    for c, end in phase_changes(phases):
        before = values[max(0, c - window):c]
        ended.append(sum(before) / len(before))
        hit = steps_to_threshold(steps[c:end], values[c:end], recover * max(ended), window)
        out.append(None if hit is None else hit - int(steps[c]))
    return out


def phase_changes(phases: Sequence[int]) -> list[tuple[int, int]]:
    """(first index of the new phase, index where it ends) per phase change."""
    changes = [i for i in range(1, len(phases)) if phases[i] != phases[i - 1]]
    return [(c, next((i for i in range(c + 1, len(phases)) if phases[i] != phases[c]), len(phases)))
            for c in changes]
