"""``benchmarks/loop_gradient_changes.py``: the batch-gradient norm's quantiles, and a change read as without it."""

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("loop_gradient_changes")


def test_the_quantiles_are_ordered_and_a_clipped_loop_reads_the_plain_loops_numbers(bench):
    x, y = bench.digits()
    median, tenth = bench.batch_norm_quantiles(x, y, draws=40)
    assert 0 < tenth < median
    clipped = bench.measure(bench.mlp(), x, y, bench.clip_norm(tenth), steps=30)[0].run_estimate
    plain = bench.measure(bench.mlp(), x, y, lambda net: None, steps=30)[0].run_estimate
    assert clipped.measured and clipped.b_simple == pytest.approx(plain.b_simple, rel=1e-6)
