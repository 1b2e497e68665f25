"""benchmarks/subset_estimators.py: its per-step formulas agree with the package's window on the same rows."""

import torch

from benchmarks.subset_estimators import step_estimates
from gns_callback.accumulation import AccumulationWindow, step_estimates as window_estimates


def test_pair_estimate_matches_the_accumulation_window():
    torch.manual_seed(0)
    g = torch.randn(1, 12, 5, dtype=torch.float64) + 0.3
    m, pairs = step_estimates(g, 4)["pairs"]
    window = AccumulationWindow()
    rows = g[0]
    window.add_micro_batch(rows[:4].pow(2).sum(), 4.0, 4.0, 12, unmeasured_sq=rows[4:].sum(0).pow(2).sum())
    trace, grad_sq, _ = window_estimates(window.packed(), rows.mean(0).pow(2).sum())
    torch.testing.assert_close(grad_sq, pairs[0])
    torch.testing.assert_close(trace, m[0] - pairs[0])


def test_every_example_measured_makes_all_three_agree():
    g = torch.randn(3, 8, 4, dtype=torch.float64)
    out = step_estimates(g, 8)
    for name in ("two-batch", "pairs"):
        torch.testing.assert_close(out[name][1], out["every example"][1])
