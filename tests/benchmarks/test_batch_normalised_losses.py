"""``benchmarks/batch_normalised_losses.py``: its exact values agree without weights, and the check's normaliser
moves only with them."""

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("batch_normalised_losses")


def test_without_weights_both_exact_values_are_the_noise_scale_and_the_normaliser_stays(bench):
    x, y = bench.digits()
    x, y = x[:300], y[:300]
    rows = bench.example_gradients(x, y)
    examples, batch_gradient = bench.exact_values(rows, torch.ones(len(y), dtype=torch.float64), draws=3000, batch=32)
    assert batch_gradient == pytest.approx(examples, rel=0.15)
    assert float(bench.normaliser_moves(x, y, None, 32, batches=2).max()) < 1e-5
    assert float(bench.normaliser_moves(x, y, bench.WEIGHTINGS["0.1-10"], 32, batches=2).max()) > 0.01
    assert bench.meter_reading(x, y, bench.WEIGHTINGS["0.1-10"], seed=0, steps=5, batch=32).steps == 5
