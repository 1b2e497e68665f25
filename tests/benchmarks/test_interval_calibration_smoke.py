"""benchmarks/interval_calibration.py: exact per-step values from the Gram matrix, and the two intervals of a run
("t(n − 1)" from the second-order sums, "kurtosis" the package's: never narrower)."""

import numpy as np
import pytest
import torch

from gns_callback.exact import exact_noise_scale


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("interval_calibration")


def test_step_estimates_from_the_gram_matrix_are_the_per_example_formulas(bench):
    rng = np.random.default_rng(0)
    grads = rng.normal(size=(50, 7)) + 0.5
    draws = rng.integers(0, 50, (4, bench.BATCH))
    trace, grad_sq = bench.step_estimates(grads @ grads.T, draws)
    batch = grads[draws]
    small, big = (batch**2).sum(-1).mean(-1), (batch.mean(1) ** 2).sum(-1)
    np.testing.assert_allclose(trace, (small - big) * 32 / 31, rtol=1e-10)
    np.testing.assert_allclose(grad_sq, (32 * big - small) / 31, rtol=1e-10)


def test_the_kurtosis_interval_holds_every_interval_before_it(bench):
    rng = np.random.default_rng(1)
    grads = np.vstack([rng.normal(size=(200, 6)) * 0.05, rng.normal(size=(3, 6)) + 2.0])  # three heavy examples
    exact = exact_noise_scale(torch.from_numpy(grads))[0]
    counts = bench.tally(grads @ grads.T, exact, runs=40, steps=60)
    before, after = np.array(counts["t(n − 1)"][3]), np.array(counts["kurtosis"][3])
    assert (after >= before).all() and (after > before).any()
    assert sum(counts["kurtosis"][:3]) == 40 and counts["kurtosis"][0] >= counts["t(n − 1)"][0]


def test_a_short_run_prints_a_row_per_model_and_step_count(bench, capsys):
    bench.main(["--runs", "3", "--steps", "20,40", "--only", "hand-written"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| hand-written")]
    assert len(rows) == 2 and "| 20 |" in rows[0] and "| 40 |" in rows[1]
