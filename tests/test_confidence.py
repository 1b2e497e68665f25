"""Fieller interval: closed-form cases and calibration by simulation."""

import math

import numpy as np
import pytest

from gns_callback.confidence import fieller_interval, t_quantile
from gns_callback.smoothing import SUM_FIELDS, summarize_ratio


def test_no_noise_collapses_to_the_ratio():
    assert fieller_interval(6.0, 2.0, 0.0, 0.0, 0.0, 1.96) == pytest.approx((3.0, 3.0))


def test_denominator_noise_only_matches_closed_form():
    # With vxx = vxy = 0 the set is |mx − R·my| ≤ t·R·sqrt(vyy): R ∈ [mx/(my + t s), mx/(my − t s)].
    mx, my, s, t = 10.0, 2.0, 0.3, 2.0
    low, high = fieller_interval(mx, my, 0.0, s * s, 0.0, t)
    assert low == pytest.approx(mx / (my + t * s))
    assert high == pytest.approx(mx / (my - t * s))


def test_unresolved_denominator_gives_an_unbounded_interval():
    low, high = fieller_interval(10.0, 0.1, 1.0, 1.0, 0.0, 1.96)
    assert math.isinf(high) and 0.0 <= low < 10.0 / 0.1


def test_significantly_negative_denominator_says_nothing():
    assert fieller_interval(10.0, -5.0, 0.1, 0.1, 0.0, 1.96) == (0.0, math.inf)


def test_t_quantile():
    assert t_quantile(0.95, 1e9) == pytest.approx(1.959964, rel=1e-5)
    assert t_quantile(0.95, 10) == pytest.approx(2.228139, rel=1e-5)
    assert math.isinf(t_quantile(0.95, 0))
    with pytest.raises(ValueError):
        t_quantile(1.5, 10)


def _weighted_sums(x: np.ndarray, y: np.ndarray, decay: float) -> np.ndarray:
    """SUM_FIELDS over the last axis, weights decay^(T−t); x, y of shape (R, T)."""
    T = x.shape[-1]
    w = decay ** np.arange(T - 1, -1, -1.0)
    cols = [np.full(x.shape[0], w.sum()), np.full(x.shape[0], (w * w).sum())]
    cols += [(w * v).sum(-1) for v in (x, y, x * x, y * y, x * y)]
    assert len(cols) == len(SUM_FIELDS)
    return np.stack(cols, axis=-1)


@pytest.mark.parametrize("decay", [1.0, 0.97])
def test_interval_covers_the_truth_95_percent_of_the_time(decay):
    """400 independent runs of 150 steps of the micro-batch estimator with B_simple = 60 > B = 32."""
    rng = np.random.default_rng(2)
    R, T, k, b, d = 400, 150, 4, 8, 24
    G = np.full(d, math.sqrt(0.4 / d))  # |G|² = 0.4, tr Σ = 24 -> B_simple = 60
    micro = G + rng.normal(size=(R, T, k, d)) / math.sqrt(b)
    small = (micro**2).sum(-1).mean(-1)
    big = (micro.mean(axis=2) ** 2).sum(-1)
    trace = (small - big) / (1 / b - 1 / (k * b))
    grad_sq = (k * b * big - b * small) / (k * b - b)
    sums = _weighted_sums(trace, grad_sq, decay)
    covered, widths = 0, []
    for row in sums:
        s = summarize_ratio(row, 0.95)
        covered += s.ci_low <= 60.0 <= s.ci_high
        widths.append(s.ci_high - s.ci_low)
    coverage = covered / R
    # Binomial standard error at 95% with R = 400 is 1.1 points: ±3 SE.
    assert 0.917 <= coverage <= 0.983, coverage
    assert np.median(widths) < 60.0  # informative, not trivially wide
