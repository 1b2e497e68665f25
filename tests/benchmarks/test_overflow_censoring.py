"""``benchmarks/overflow_censoring.py``: with nothing left out its batches read the exact value, leaving out the
largest reads higher, and its GradScaler loop runs."""

import pytest
import torch.nn.functional as F

from gns_callback.exact import exact_noise_scale, per_example_gradients


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("overflow_censoring")


def test_batches_left_out_by_size_read_high(bench):
    x, y = bench.data("bc")
    rows = per_example_gradients(bench.trained_mlp("breast cancer", x, y, steps=20), F.cross_entropy, x, y)
    exact = exact_noise_scale(rows)[0]
    parts = bench.batch_parts(rows, batches=4000)
    assert bench.left_out_by_size(*parts, 0.0) == pytest.approx(exact, rel=0.1)
    assert bench.left_out_by_size(*parts, 0.05) > bench.left_out_by_size(*parts, 0.0)


def test_the_grad_scaler_loop_counts_its_overflows(bench):
    meter, overflowed, settled = bench.scaled_run(growth_interval=1, steps=20)
    assert settled > 0 and overflowed == meter.overflows.overflowed
    assert bench.without_the_rule(meter).steps == meter.steps_seen - meter.run_estimate.skipped_steps
