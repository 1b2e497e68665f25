"""benchmarks/budget_allocation.py: its reduced-budget estimators reduce to the full one at the full budget."""

import pytest
import torch


@pytest.fixture(scope="module")
def budget(load_benchmark):
    return load_benchmark("budget_allocation")


@pytest.fixture(scope="module")
def stream():
    torch.manual_seed(0)
    rows = torch.randn(40, 6, dtype=torch.float64) + 0.4
    batches = torch.randint(0, 40, (30, 8))
    return rows, batches


def test_every_step_and_every_example_give_the_full_estimate(budget, stream):
    rows, batches = stream
    values = budget.step_values(rows, batches, subsets=[8])
    full = budget.full(values["big"], values["every"], 8)
    assert budget.mixed(values["big"], values["every"], 8, every=1) == pytest.approx(full, rel=1e-12)
    assert budget.subset_blend(values, 8, 8) == pytest.approx(full, rel=1e-9)


def test_full_estimate_is_the_ratio_of_unbiased_sums(budget, stream):
    rows, batches = stream
    g = rows[batches]
    m = g.square().sum(-1).mean(1)
    big = g.mean(1).square().sum(-1)
    trace = 8 * (m - big) / 7
    expected = float(trace.sum() / (big - trace / 8).sum())
    values = budget.step_values(rows, batches, subsets=[8])
    assert budget.full(values["big"], values["every"], 8) == pytest.approx(expected, rel=1e-12)


def test_run_on_one_small_case_reports_every_row(budget, stream):
    rows, _ = stream
    results = budget.run(streams=2, steps=24, batch=8, fractions=[2], case_list=[("toy", "toy rows", rows)])
    errors = results[0]["errors"]
    assert {"every example, every step", "1/2: every example, 1 step in 2", "1/2: 4 of 8 examples every step",
            budget.ADAPTDL} <= set(errors)
    assert all(len(v) == 2 for v in errors.values())
    assert "| pooled |" in budget.to_markdown(results, "cmd", 2, 24, 8, 1.0)
