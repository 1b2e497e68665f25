"""``benchmarks/coupling_check.py``: every loss and layer of its table reads as it should (independent or coupled),
on the MLP cases (the scan models are the model scan's own and read independent in the unit tests' shapes)."""

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("coupling_check")


def test_each_mlp_case_reads_as_expected(bench, digits):
    x, y = digits[0][: bench.BATCH], digits[1][: bench.BATCH]
    for name, make, loss, reads_tokens, expected in bench.CASES:
        if name.startswith("MLP"):
            result, check_ms, step_ms = bench.measure(make, loss, x, y)
            assert result.status == expected, (name, result)
            assert check_ms > 0 and step_ms > 0
