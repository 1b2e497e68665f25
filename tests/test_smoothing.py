"""RatioAccumulator: weights, bias correction, skipped steps, state round trip."""

import math

import numpy as np
import pytest
import torch

from gns_callback.smoothing import SECOND_ORDER_FIELDS, RatioAccumulator, excess_kurtosis, summarize_ratio


def _feed(acc, pairs, valid=None):
    for i, (x, y) in enumerate(pairs):
        ok = True if valid is None else valid[i]
        acc.update(torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64), torch.tensor(ok))


def test_weighted_means_equal_bias_corrected_ema():
    decay, xs, ys = 0.9, [1.0, 4.0, -2.0, 3.0], [0.5, 0.1, 0.3, -0.2]
    acc = RatioAccumulator(decay)
    _feed(acc, zip(xs, ys))
    m_x = m_y = 0.0
    for x, y in zip(xs, ys):  # Adam-style EMA, then bias correction
        m_x, m_y = decay * m_x + (1 - decay) * x, decay * m_y + (1 - decay) * y
    correction = 1 - decay ** len(xs)
    s = acc.summary()
    assert s.mean_x == pytest.approx(m_x / correction)
    assert s.mean_y == pytest.approx(m_y / correction)
    assert s.ratio == pytest.approx((m_x / correction) / (m_y / correction))


def test_negative_single_steps_are_kept_and_the_ratio_formed_at_read_time():
    acc = RatioAccumulator(1.0)
    _feed(acc, [(10.0, -1.0), (10.0, 3.0)])
    s = acc.summary()
    assert s.mean_y == pytest.approx(1.0)  # the negative step counts, unclamped
    assert s.ratio == pytest.approx(10.0)


def test_invalid_steps_change_nothing():
    a, b = RatioAccumulator(0.8), RatioAccumulator(0.8)
    _feed(a, [(1.0, 2.0), (3.0, 1.0)])
    _feed(b, [(1.0, 2.0), (math.inf, math.nan), (3.0, 1.0)], valid=[True, False, True])
    assert torch.equal(a.sums, b.sums)


def test_decay_zero_keeps_only_the_last_step_and_reports_no_interval():
    acc = RatioAccumulator(0.0)
    _feed(acc, [(1.0, 2.0), (9.0, 3.0)])
    s = acc.summary()
    assert s.ratio == pytest.approx(3.0) and s.effective_steps == pytest.approx(1.0)
    assert (s.ci_low, s.ci_high) == (0.0, math.inf)


def test_effective_steps_and_empty_summary():
    acc = RatioAccumulator(1.0)
    assert math.isnan(acc.summary().ratio)
    _feed(acc, [(1.0, 1.0)] * 10)
    assert acc.summary().effective_steps == pytest.approx(10.0)


def test_unresolved_denominator_reads_as_infinite():
    assert math.isinf(summarize_ratio([2, 2, 1.0, -1.0, 1, 1, -1]).ratio)


def test_state_round_trip_is_exact():
    a = RatioAccumulator(0.95)
    _feed(a, [(float(i), 1.0 / (i + 1)) for i in range(7)])
    b = RatioAccumulator(0.5)
    b.load_state_dict(a.state_dict())
    assert b.decay == 0.95 and torch.equal(a.sums, b.sums)
    _feed(a, [(2.0, 1.0)])
    _feed(b, [(2.0, 1.0)])
    assert torch.equal(a.sums, b.sums)


def test_rejects_bad_decay():
    with pytest.raises(ValueError, match="decay"):
        RatioAccumulator(1.5)


def test_excess_kurtosis_from_the_sums_is_the_weighted_kurtosis_of_x_minus_r_y():
    rng = np.random.default_rng(0)
    xs, ys = rng.standard_t(4, 60) + 5.0, rng.exponential(size=60)
    acc = RatioAccumulator(0.97)
    _feed(acc, zip(xs.tolist(), ys.tolist()))
    w = 0.97 ** np.arange(59, -1, -1.0)
    r = (w * xs).sum() / (w * ys).sum()
    z = xs - r * ys  # its weighted mean is zero at r
    want = (w * z**4).sum() / w.sum() / ((w * z * z).sum() / w.sum()) ** 2 - 3.0
    assert excess_kurtosis(acc.sums.tolist(), r) == pytest.approx(want, rel=1e-9)


def test_kurtosis_lost_to_rounding_or_not_kept_is_unknown():
    acc = RatioAccumulator(1.0)
    _feed(acc, [(1e8 + 1e-4 * k, 1.0) for k in range(10)])  # z⁴ cancels to nothing against x⁴
    assert math.isnan(excess_kurtosis(acc.sums.tolist(), acc.summary().ratio))
    assert math.isnan(excess_kurtosis(acc.sums[:SECOND_ORDER_FIELDS].tolist(), 1.0))


def test_a_state_saved_before_the_fourth_moments_resumes_with_the_interval_it_had():
    """Seven sums (the state before this change): the same interval as then (Student-t at n − 1), and the fourth
    moments stay unknown for the rest of the run rather than read from part of it."""
    before = RatioAccumulator(1.0)
    _feed(before, [(float(k % 5), 1.0 + 0.1 * k) for k in range(20)])
    old_state = {"decay": 1.0, "sums": before.sums[:SECOND_ORDER_FIELDS].tolist()}
    resumed = RatioAccumulator(1.0)
    resumed.load_state_dict(old_state)
    assert resumed.summary() == summarize_ratio(old_state["sums"])
    _feed(resumed, [(3.0, 2.0)])
    assert torch.isnan(resumed.sums[SECOND_ORDER_FIELDS:]).all()
    assert resumed.summary() == summarize_ratio(resumed.sums[:SECOND_ORDER_FIELDS].tolist())


def test_a_ratio_too_large_for_its_fourth_power_reads_without_raising():
    """|G|² resolved at 1e-300 against tr Σ near 1: R̂⁴ overflows. Before, ``R̂**4`` raised OverflowError at read
    time (in a fit: inside the callback's logging); now the kurtosis is unknown and the interval is Student-t's."""
    acc = RatioAccumulator(1.0)
    _feed(acc, [(1.0, 1e-300), (2.0, 2e-300), (1.5, 2.9e-300)])
    summary = acc.summary()
    assert summary.ratio > 1e299 and summary == summarize_ratio(acc.sums[:SECOND_ORDER_FIELDS].tolist())

