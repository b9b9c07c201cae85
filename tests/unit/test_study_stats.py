"""Confidence intervals and run summaries against slow, obviously-correct references."""

from __future__ import annotations

import math
import random

import pytest

from sao_megatron.algorithms.stats import (adaptation_steps, steps_to_threshold, t_interval, trailing_mean,
                                           wilson_interval)

pytestmark = pytest.mark.unit


def _slow_wilson(k: int, n: int) -> tuple[float, float]:
    """Reference: the Wilson interval is the set of p whose score test does not reject,
    |k/n - p| <= z sqrt(p(1-p)/n); found by scanning p on a fine grid."""
    z = 1.959963984540054
    ok = [i / 200000 for i in range(200001) if abs(k / n - i / 200000) <= z * math.sqrt(i / 200000 * (1 - i / 200000) / n)]
    return min(ok), max(ok)


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (37, 128), (1, 1)])
def test_wilson_matches_the_inverted_score_test(k, n):
    low, high = wilson_interval(k, n)
    ref_low, ref_high = _slow_wilson(k, n)
    assert low == pytest.approx(ref_low, abs=2e-5) and high == pytest.approx(ref_high, abs=2e-5)


def test_t_interval_covers_the_true_mean_about_95_percent():
    """Coverage check: intervals from 3 normal draws contain the mean ~95 % of the time (a normal
    approximation with z=1.96 would cover only ~80 % at n=3)."""
    rng = random.Random(0)
    hits = 0
    for _ in range(4000):
        _, lo, hi = t_interval([rng.gauss(2.0, 1.0) for _ in range(3)])
        hits += lo <= 2.0 <= hi
    assert 0.93 < hits / 4000 < 0.97
    assert t_interval([0.5]) == (0.5, 0.5, 0.5)
    mean, lo, hi = t_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and hi - mean == pytest.approx(4.302652729911275 * 1.0 / math.sqrt(3))


def test_steps_to_threshold_uses_the_trailing_mean():
    steps = list(range(10))
    vals = [0, 0, 1, 0, 1, 1, 1, 1, 1, 1]
    # trailing 3-mean: ..., at step 4 (0,1,... -> (1+0+1)/3=0.67), step 5 (0+1+1)/3, step 6 = 1.0
    assert steps_to_threshold(steps, vals, 0.9, window=3) == 6
    assert steps_to_threshold(steps, vals, 2.0, window=3) is None


def test_adaptation_steps_per_phase_change():
    steps = list(range(30))
    vals = [1.0] * 10 + [0.0, 0.2, 0.5, 0.95, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0] + [0.0] * 10
    phases = [0] * 10 + [1] * 10 + [2] * 10
    # phase 1: pre-shift mean 1.0 -> target 0.9; trailing 1-point value >= 0.9 first at index 13.
    assert adaptation_steps(steps, vals, phases, window=1) == [3, None]


def test_adaptation_back_to_a_learnt_target_climbs_to_its_level():
    """A phase the run never learns (reward 0.2), then the first target again: recovery is measured
    against the 1.0 the first phase ended at, not against the 0.2 just before the change (which every
    step after it already 'recovers')."""
    steps = list(range(30))
    vals = [1.0] * 10 + [0.2] * 10 + [0.3, 0.5, 0.7, 0.85, 0.95, 1.0, 1.0, 1.0, 1.0, 1.0]
    phases = [0] * 10 + [1] * 10 + [2] * 10
    # phase 1 never reaches 0.9; phase 2 first reaches 0.9 x 1.0 at index 24 (0.95), 4 steps in
    assert adaptation_steps(steps, vals, phases, window=1) == [None, 4]


@pytest.mark.parametrize("window", [1, 3, 10])
def test_trailing_mean_matches_a_slice_per_point(window):
    rng = random.Random(7)
    values = [rng.uniform(-1, 1) for _ in range(25)]
    slow = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]
    assert trailing_mean(values, window) == pytest.approx(slow)
