"""benchmarks/optimizer_trajectories.py: a short run reports every case, and each reading is compared with the
exact value of the parameters at that step."""

import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("optimizer_trajectories")


def test_a_short_run_reports_every_case(bench):
    text = bench.main(["--seeds", "1", "--steps", "100"])
    assert text.count("\n| ") == len(bench.CASES) + 1  # the header and one row per case
    assert all(optimizer in text for _, optimizer, _ in bench.CASES)


def test_readings_are_of_the_current_parameters(bench):
    (step, exact, estimate), = bench.readings("wine", "Adam", 3e-3, seed=0, steps=100)
    assert step == 100 and exact > 0 and estimate.steps == 100
