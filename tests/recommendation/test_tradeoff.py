import math

import numpy as np
import pytest

from gns_callback.recommendation import examples_factor, steps_factor, steps_for_examples_factor, throughput_at


def test_both_factors_are_two_at_the_noise_scale():
    for b in (1.0, 37.5, 4096.0):
        assert steps_factor(b, b) == pytest.approx(2.0)
        assert examples_factor(b, b) == pytest.approx(2.0)


def test_hyperbola_identity():
    rng = np.random.default_rng(0)
    for batch, b_noise in rng.uniform(1, 10_000, size=(200, 2)):
        s, e = steps_factor(batch, b_noise), examples_factor(batch, b_noise)
        assert (s - 1) * (e - 1) == pytest.approx(1.0)
        assert steps_for_examples_factor(e) == pytest.approx(s)
        # (1 + r)(1 + 1/r) = 2 + r + 1/r ≥ 4: the product is smallest at the knee r = B/B_noise = 1
        assert s * e >= 4 - 1e-9


def test_limits():
    assert steps_factor(64, math.inf) == math.inf
    assert examples_factor(64, math.inf) == 1.0
    assert examples_factor(64, 0.0) == math.inf
    assert steps_factor(64, 0.0) == 1.0
    assert math.isnan(steps_factor(64, math.nan)) and math.isnan(examples_factor(64, math.nan))
    # Twice the noise scale: 1.5x the minimum steps, 3x the minimum examples.
    assert (steps_factor(200, 100), examples_factor(200, 100)) == pytest.approx((1.5, 3.0))


def test_throughput_interpolation():
    table = {16: 800.0, 32: 1200.0, 64: 1400.0}
    assert throughput_at(table, 32) == 1200.0
    assert throughput_at(table, 48) == pytest.approx(1300.0)
    assert throughput_at(table, 8) == pytest.approx(400.0)  # constant time per micro-batch below the table
    assert throughput_at(table, 512) == 1400.0  # saturated above it
    assert throughput_at({}, 32) is None
    assert throughput_at({16: float("nan")}, 32) is None
