"""benchmarks/left_out_coverage.py: a short run covers every model, and "before" is the meter's interval without the
widening (never wider than "now")."""

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("left_out_coverage")


def test_a_short_run_reports_every_model(bench):
    text = bench.main(["--streams", "1", "--steps", "20"])
    assert all(name in text for name in bench.MODELS)


def test_before_is_the_interval_without_the_widening(bench):
    intervals = bench.stream(bench.MODELS["learned logit scale 0.05 (at initialisation)"](), seed=0, steps=40)
    for averaging in ("run", "recent"):
        (low, high), (low_before, high_before) = intervals[f"{averaging} now"], intervals[f"{averaging} before"]
        assert low < low_before and high_before < high
