"""``benchmarks/batch_normalised_losses.py``: its exact values agree without weights, the check's normaliser moves
only with them, the token rows sum to the batch's gradient, and RMSE's batch gradient is less noisy than its
examples'."""

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


def test_the_token_rows_sum_to_the_batch_gradient_and_the_check_tells_the_counts_apart(bench):
    x, y = bench.digits()
    tokens, lengths = x[:40].reshape(-1, 8, 8), bench.token_lengths(y[:40])
    targets = bench.token_targets(y[:40], lengths["1–8, by class"])
    net = bench.TokenNet().double()
    bench.token_loss(net, tokens.double(), targets, "sum").backward()
    whole = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    assert torch.allclose(bench.token_rows(tokens, targets).sum(0), whole, rtol=1e-9, atol=1e-12)
    statuses = {name: bench.token_reading(tokens, bench.token_targets(y[:40], kept), 0, steps=3)[0]
                for name, kept in lengths.items()}
    assert statuses == {"all 8": ("independent", "independent"),
                        **{name: ("weighted mean", "scaled by the batch")
                           for name in ("1–8, drawn apart", "1–8, by class", "8 for class 0, else 1")}}


def test_rmse_batch_gradient_is_less_noisy_than_its_examples_and_the_check_refuses_it(bench):
    x, y = bench.diabetes()
    examples, at_32 = bench.rmse_exact(x, y, draws=2000, batch=32)
    assert 9.0 < examples < 9.6 and at_32 < 0.97 * examples  # 9.28 and 8.64 over 20,000 draws (RESULTS.md)
    assert bench.rmse_reading(x, y, seed=0, steps=3, rmse=True).steps == 3
    assert bench.rmse_check(x, y).status == "scaled by the batch"
