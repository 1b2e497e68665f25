"""``benchmarks/trajectory_tracking.py``: its scores on hand-made readings, and a short real run end to end."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("trajectory_tracking")


def test_score_counts_unresolved_readings_apart_and_coverage_on_all(bench):
    exact = np.full(6, 10.0)
    estimate = np.array([[np.nan], [20.0], [5.0], [np.inf], [0.0], [10.0]])
    low, high = np.array([[0.0], [15.0], [4.0], [8.0], [0.0], [9.0]]), np.array([[1.0], [30.0], [12.0], [np.inf],
                                                                                   [np.inf], [11.0]])
    s = bench.score((estimate, low, high), exact, exact, start=0)
    assert s["readings"] == 5  # the NaN row was not read
    assert s["unresolved"] == pytest.approx(2 / 5)
    assert s["gm"] == pytest.approx(1.0)  # 2×, ½× and 1×
    assert s["error"] == pytest.approx(math.exp(2 * math.log(2) / 3))
    assert s["coverage"] == pytest.approx(4 / 5) and s["local_coverage"] == s["coverage"]


def test_pooled_weights_trajectories_by_their_readings(bench):
    a = {"gm": 2.0, "error": 2.0, "unresolved": 0.0, "coverage": 1.0, "local_coverage": 1.0, "readings": 30}
    b = {"gm": 0.5, "error": 2.0, "unresolved": 0.0, "coverage": 0.0, "local_coverage": 0.5, "readings": 10}
    p = bench.pooled([a, b])
    assert p["gm"] == pytest.approx(math.exp((30 * math.log(2) + 10 * math.log(0.5)) / 40))
    assert p["coverage"] == pytest.approx(0.75) and p["local_coverage"] == pytest.approx(35 / 40)


def test_local_value_is_the_ratio_of_trailing_means(bench):
    rng = np.random.default_rng(0)
    exact = np.column_stack([np.zeros(40), rng.uniform(1, 2, 40), rng.uniform(5, 9, 40)])
    local = bench.local_value(exact, steps=5)
    for t in (4, 17, 39):
        assert local[t] == pytest.approx(exact[t - 4:t + 1, 2].mean() / exact[t - 4:t + 1, 1].mean())


def test_short_logistic_regression_run(bench):
    """70 steps on breast cancer: every estimator read; the tracker far closer to the exact value than the EMA."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        case = bench.CASES[1]
        result = bench.evaluate(bench.Case(case.name, case.data, case.model, case.loss, case.optimizer, 70),
                                seeds=1, replicas=2, steps=70, every=5)
    finally:
        torch.set_num_threads(threads)
    scores = result["methods"]["per_example"]
    assert set(scores) >= {"EMA of parts (previous meter, decay 0.99)", "LocalLinearRatio", "ratio-scale EMA"}
    assert all(v["all"]["readings"] == 2 * 4 for v in scores.values())  # steps 50, 55, 60, 65 × 2 replicas
    tracker, ema = scores["LocalLinearRatio"]["all"]["gm"], scores["EMA of parts (previous meter, decay 0.99)"]["all"]["gm"]
    assert abs(math.log(tracker)) < abs(math.log(ema)) - 1.0
    assert bench.case_markdown(result)[0].startswith("### breast-cancer")
