"""``benchmarks/shuffled_epochs.py``: a short stream end to end, and its summary row."""

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("shuffled_epochs")


@pytest.mark.parametrize("method, passes, size", [("per_example", 1, 16), ("micro_batch", 4, 4)])
def test_a_short_stream_reads_a_finite_estimate(bench, method, passes, size):
    x, y, loss, outputs = bench.load("wine")
    net = bench.trained_mlp(x, y, loss, outputs)
    estimates = [bench.stream(net, loss, bench.shuffled_batches(x, y, size, seed), method, passes, size, 30, len(x))
                 for seed in range(2)]
    assert all(e.steps == 30 and e.method == method for e in estimates)
    first = estimates[0]
    row = bench.summary(estimates, (first.b_simple, first.grad_sq_norm, first.trace_sigma)).split(" | ")
    assert len(row) == 4 and row[3] in ("1/2", "2/2"), row  # the first stream's interval holds its own value
