"""``benchmarks/bcrit/problems.py``: every problem's exact per-step quantities against brute force."""

from __future__ import annotations

import math

import pytest
import torch

from gns_callback.exact import exact_b_simple
from gns_callback.per_example import PerExampleNormTracker


@pytest.fixture(scope="module")
def problems(load_benchmark):
    load_benchmark("critical_batch_summary")  # puts the repository root on the path for the bcrit package
    from benchmarks.bcrit import problems

    return problems


@pytest.mark.parametrize("name", ["mlp", "cnn", "bc_mlp", "wine_mlp", "diabetes_mlp"])
def test_exact_sums_match_per_example_gradients(problems, name):
    """What the critical-batch study records as exact is the brute-force ``|G|²`` and ``tr Σ`` over the whole data
    set, and the gradients the training loop left in ``.grad`` are put back."""
    problem = problems.PROBLEMS[name]
    x, y = problem.data()
    x, y = x[:300], y[:300]
    net = problem.make_net()
    tracker = PerExampleNormTracker(net, max_examples=16).attach()
    problem.loss(net(x[:8]), y[:8]).backward()
    tracker.pop()
    before = [p.grad.clone() for p in net.parameters()]
    grad_sq, trace = problems.ExactSums(tracker, x, y, problem.loss)(net)
    _, want_grad_sq, want_trace = exact_b_simple(net, problem.loss, x, y)
    assert math.isclose(grad_sq, want_grad_sq, rel_tol=1e-5)
    assert math.isclose(trace, want_trace, rel_tol=1e-5)
    assert all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))
    assert tracker.max_examples == 16


def test_recommended_moves_follow_each_runs_interval(load_benchmark):
    """A run whose interval lies wholly above its batch moves to the interval's near end; one whose interval holds
    its batch keeps it; the predicted ratios come from the slow-way fit."""
    summary = load_benchmark("critical_batch_summary")
    from gns_callback.critical_batch import CriticalBatchEstimate

    def row(batch_size, b_crit, low, high):
        estimate = CriticalBatchEstimate(b_crit, low, high, 0.95, (b_crit,), 2.0, 0.05, 500, "log-loss midpoint")
        return dict(batch_size=batch_size, tuned=True, estimate=estimate)

    problem = summary.PROBLEMS["mlp"]
    p = dict(fit=dict(b_crit=32.0, s_min=100.0), problem=problem,
             rows=[row(8, 40.0, 30.0, 50.0), row(32, 35.0, 20.0, 60.0), row(512, 40.0, 10.0, 2000.0)])
    text = summary.recommended_moves(p)
    assert text.startswith("Recommended batch from the 3 tuned runs: kept in 2, moved in 1 (8 → ")
    moved_to = int(text.split("8 → ")[1].split(")")[0])
    assert 24 <= moved_to <= 48, text
    steps = (1 + 32.0 / moved_to) / (1 + 32.0 / 8)
    assert f"predicted steps ×{steps:.2f}–{steps:.2f}" in text, text


def test_batch_norm_problems_keep_their_running_statistics(problems, load_benchmark):
    """The study's own passes over the whole set (the exact sums, in train mode; the target loss, in eval mode)
    leave a BatchNorm network's running statistics and mode as the training run left them (before, the exact sums'
    pass moved the running statistics toward the whole set's, so recorded runs were read at other eval losses)."""
    load_benchmark("critical_batch_summary")
    from benchmarks.bcrit.training import full_loss

    problem = problems.PROBLEMS["cnn_bn"]
    x, y = problem.data()
    x, y = x[:200], y[:200]
    net = problem.make_net()
    tracker = PerExampleNormTracker(net, max_examples=16).attach()
    problem.loss(net(x[:8] * 3.0), y[:8]).backward()  # running statistics away from the whole set's
    tracker.pop()
    before = [b.clone() for b in net.buffers()]
    problems.ExactSums(tracker, x, y, problem.loss)(net)
    full_loss(net, x, y, problem.loss)
    assert all(torch.equal(b, a) for b, a in zip(net.buffers(), before))
    assert net.training and net[2].training
