"""``benchmarks/padded_sequences.py``: the exact value's rows are the batch's gradient (the constant divisor), a padded
model's first batch reads independent and measures, and the sequence-first batch is refused as misread."""

import pytest
import torch


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("padded_sequences")


@pytest.fixture(scope="module")
def data(bench):
    x, y = bench.digits()
    return bench.row_data(x[:64], y[:64], "by-class")


def test_the_examples_token_sums_over_the_constant_divisor_are_the_batch_gradient(bench, data):
    """Σ_i ∇(Σ_t l_it) / (B·c) is the batch loss's gradient: each example's padded positions add nothing."""
    c = float(data[1].double().mean())
    loss, net = bench.token_loss(c), bench.Encoder().double()
    x, lengths, targets = data[0].double(), data[1], data[2]
    whole = torch.autograd.grad(loss(net, (x, lengths, targets)), list(net.parameters()))
    parts = [torch.autograd.grad(loss(net, (x[i:i + 1], lengths[i:i + 1], targets[i:i + 1])), list(net.parameters()))
             for i in range(len(x))]
    for k, g in enumerate(whole):
        assert torch.allclose(g, sum(p[k] for p in parts) / len(x), atol=1e-10)


def test_a_padded_encoder_measures_and_the_sequence_first_batch_is_refused(bench, data):
    c = float(data[1].double().mean())
    estimate, check = bench.plain_reading(bench.Encoder, data, bench.token_loss(c), seed=0, steps=5)
    assert check == "independent" and estimate.steps == 5
    estimate, check = bench.plain_reading(bench.SequenceFirstLstm, data, bench.token_loss(c), seed=0, steps=5,
                                          layout=bench.sequence_first)
    assert check == "batch size misread" and estimate.steps == 0
