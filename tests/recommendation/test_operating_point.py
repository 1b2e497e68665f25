import math

import pytest

from gns_callback.recommendation.operating_point import Economics, operating_point, time_to_target_ratio, with_target
from gns_callback.recommendation.trust import EstimateView

EST = EstimateView(100.0, 80.0, 125.0, 400)


def test_factors_at_the_estimate_and_interval_ends():
    p = operating_point(50, 50, 1, 1, 0.1, EST, Economics({}, None, None))
    assert (p.steps_factor, p.examples_factor) == pytest.approx((3.0, 1.5))
    assert (p.steps_factor_at_ci_low, p.steps_factor_at_ci_high) == pytest.approx((1 + 80 / 50, 1 + 125 / 50))
    assert p.samples_per_sec is None and p.steps_per_epoch is None and p.cost_per_epoch is None


def test_throughput_time_cost_and_target():
    econ = Economics({32: 500.0, 64: 1000.0}, 10_000.0, 3.0)
    cur = operating_point(64, 32, 1, 2, 0.1, EST, econ)
    rec = operating_point(256, 64, 2, 2, 0.4, EST, econ)
    assert rec.samples_per_sec == pytest.approx(2000.0) and rec.epoch_seconds == pytest.approx(5.0)
    assert rec.cost_per_epoch == pytest.approx(3.0 * 2 * 5.0 / 3600) and rec.steps_per_epoch == math.ceil(10_000 / 256)
    expected = (rec.examples_factor / 2000.0) / (cur.examples_factor / 1000.0)
    assert time_to_target_ratio(cur, rec) == pytest.approx(expected)
    cur_t, rec_t = with_target(cur, rec, 10.0)
    assert cur_t.epochs_to_target == 10.0
    assert rec_t.epochs_to_target == pytest.approx(10.0 * rec.examples_factor / cur.examples_factor)
    assert with_target(cur, rec, None) == (cur, rec)
