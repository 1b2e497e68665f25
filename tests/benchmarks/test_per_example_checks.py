"""``benchmarks/per_example_checks.py``: every loss and layer of its table reads as it should (independent, coupled or
an extra gradient), on the MLP and token cases (the scan models are the model scan's own)."""

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("per_example_checks")


def test_each_mlp_case_reads_as_expected(bench, digits):
    x, y = digits[0][: bench.BATCH], digits[1][: bench.BATCH]
    for name, make, loss, reads_tokens, expected in bench.CASES:
        if name.startswith(("MLP", "tokens")):
            inputs = (x * 16).round().long() if reads_tokens else x
            result, check_ms, step_ms = bench.measure(make, loss, inputs, y)
            assert result.status == expected, (name, result)
            assert check_ms > 0 and step_ms > 0


def test_the_own_loop_rows_refuse_what_the_first_step_finds_and_measure_the_rest(bench, digits, monkeypatch):
    monkeypatch.setattr(bench, "STREAMS", 1)
    monkeypatch.setattr(bench, "STEPS", 20)
    x, y = digits
    tokens = (x * 16).round().long()
    plain = bench.own_loop_row(*bench.OWN_LOOP[0][:3], x, y, 0.0)
    assert "measured (sums checked), same numbers as stream 0 before" in plain
    name, make, loss, _, strength = bench.OWN_LOOP[-1]
    assert "not measured (extra gradient)" in bench.own_loop_row(name, make, loss, tokens, y, strength)
