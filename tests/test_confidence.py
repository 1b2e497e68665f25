"""Fieller interval: closed-form cases and calibration by simulation."""

import math

import numpy as np
import pytest

from gns_callback.confidence import fieller_interval, kurtosis_dof, t_quantile
from gns_callback.smoothing import SECOND_ORDER_FIELDS, SUM_FIELDS, moment_columns, summarize_ratio


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
    cols = [(w * v).sum(-1) for v in moment_columns(x, y, np.ones_like(x))]
    cols[1] = np.full(x.shape[0], (w * w).sum())
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


def test_kurtosis_dof_keeps_n_minus_one_for_normal_tails_or_unknown():
    assert kurtosis_dof(150.0, 0.0) == 149.0
    assert kurtosis_dof(150.0, -1.2) == 149.0  # lighter tails never narrow the interval
    assert kurtosis_dof(150.0, math.nan) == 149.0
    assert kurtosis_dof(101.0, 6.0) == pytest.approx(1.0 / (1.0 / 100.0 + 6.0 / 202.0))
    assert kurtosis_dof(150.0, 50.0) < kurtosis_dof(150.0, 5.0) < 149.0


@pytest.mark.parametrize("draw, kurtosis", [("exponential", 6.0), ("laplace", 3.0), ("normal", 0.0)])
def test_kurtosis_dof_gives_the_variance_of_the_spread(draw, kurtosis):
    """A spread read from n draws varies as 2/ν about σ² (the χ²_ν/ν that Student-t assumes): simulated."""
    rng = np.random.default_rng(0)
    n = 60
    values = getattr(rng, draw)(size=(20000, n))
    relative = values.var(axis=1, ddof=1) / values.var()
    assert np.var(relative) == pytest.approx(2.0 / kurtosis_dof(n, kurtosis), rel=0.08)


def _rare_pairs(runs: int, steps: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-step (tr Σ̂, |Ĝ|²) at batch 32 from a population where 15 of 1797 examples carry nearly all of the
    gradient, along one direction (as HF Swin's at initialisation on the digits): |G|² is read from the rare
    batches holding two of them, so its per-step values are a few spikes among near-zeros."""
    rng = np.random.default_rng(0)
    g = 0.01 * rng.normal(size=(1797, 16))
    g[:15] = np.eye(16)[0] + 0.5 * rng.normal(size=(15, 16))
    mean = g.mean(0)
    exact = ((g - mean) ** 2).sum(1).mean() / (mean @ mean)
    draws = rng.integers(0, 1797, (runs, steps, 32))
    big, small = (g[draws].mean(2) ** 2).sum(-1), (g * g).sum(1)[draws].mean(-1)
    return (small - big) * 32 / 31, (32 * big - small) / 31, exact


def test_heavy_tailed_steps_widen_the_interval_where_it_missed():
    """Student-t at n − 1 (the second-order sums alone, as before) held the exact value in 82% of these runs, all
    misses too high; the kurtosis-adjusted degrees of freedom hold it in 89%. Not yet the nominal 95%: a mean of a
    few spikes is not normal at 150 steps (benchmarks/RESULTS.md, "Heavy-tailed steps")."""
    trace, grad_sq, exact = _rare_pairs(400, 150)
    sums = _weighted_sums(trace, grad_sq, 1.0)
    before = [summarize_ratio(row[:SECOND_ORDER_FIELDS]) for row in sums]
    after = [summarize_ratio(row) for row in sums]
    held_before = np.mean([s.ci_low <= exact <= s.ci_high for s in before])
    held_after = np.mean([s.ci_low <= exact <= s.ci_high for s in after])
    assert held_before < 0.86 and held_after >= held_before + 0.05, (held_before, held_after)
    assert all(a.ci_low <= b.ci_low and a.ci_high >= b.ci_high for a, b in zip(after, before))  # only wider


def test_normal_tailed_steps_keep_their_interval():
    """The micro-batch estimator's steps above: the kurtosis changes the interval's width by under 2%."""
    rng = np.random.default_rng(2)
    G = np.full(24, math.sqrt(0.4 / 24))
    micro = G + rng.normal(size=(100, 150, 4, 24)) / math.sqrt(8)
    small, big = (micro**2).sum(-1).mean(-1), (micro.mean(axis=2) ** 2).sum(-1)
    sums = _weighted_sums((small - big) / (1 / 8 - 1 / 32), (32 * big - 8 * small) / 24, 1.0)
    ratios = [(summarize_ratio(row).ci_high - summarize_ratio(row).ci_low)
              / (summarize_ratio(row[:SECOND_ORDER_FIELDS]).ci_high - summarize_ratio(row[:SECOND_ORDER_FIELDS]).ci_low)
              for row in sums]
    assert 1.0 <= np.median(ratios) < 1.02
