"""AccumulationWindow + step_estimates on deterministic inputs."""

import pytest
import torch

from gns_callback.accumulation import AccumulationWindow, step_estimates
from gns_callback.estimators import effective_batch_size, grad_sq_norm_estimate, trace_sigma_estimate


def test_equal_micro_batches_reduce_to_the_two_batch_formula():
    micro = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, -1.0]), torch.tensor([0.5, 0.5])]
    b = 4
    window = AccumulationWindow(loss_divisor=len(micro))  # .grad = the mean of the micro-batch gradients
    for g in micro:
        window.add_micro_batch(g.pow(2).sum() * b, float(b), 1.0, b)
    step_grad = sum(micro) / len(micro)
    trace, grad_sq, valid = step_estimates(window.packed(), step_grad.pow(2).sum())
    small = sum(g.pow(2).sum() for g in micro) / 3
    big = step_grad.pow(2).sum()
    assert valid
    assert trace.item() == pytest.approx(trace_sigma_estimate(small, big, 4, 12).item())
    assert grad_sq.item() == pytest.approx(grad_sq_norm_estimate(small, big, 4, 12).item())


def test_partial_window_uses_effective_sizes():
    sizes = [8, 3]
    micro = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])]
    window = AccumulationWindow(loss_divisor=2)
    for s, g in zip(sizes, micro):
        window.add_micro_batch(g.pow(2).sum() * s, float(s), 1.0, s)
    big = (sum(micro) / 2).pow(2).sum()
    trace, _, _ = step_estimates(window.packed(), big)
    small = (8 * 1.0 + 3 * 4.0) / 11
    expected = trace_sigma_estimate(small, big.item(), 11 / 2, effective_batch_size(sizes))
    assert trace.item() == pytest.approx(expected)


def test_one_micro_batch_is_not_measurable_and_non_finite_is_invalid():
    window = AccumulationWindow()
    window.add_micro_batch(torch.tensor(5.0), 4.0, 1.0, 4)
    _, _, valid = step_estimates(window.packed(), torch.tensor(1.0))
    assert not valid
    window.add_micro_batch(torch.tensor(float("inf")), 4.0, 1.0, 4)
    _, _, valid = step_estimates(window.packed(), torch.tensor(1.0))
    assert not valid


def test_empty_window_packs_zeros_for_the_all_reduce():
    window = AccumulationWindow()
    expected = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.float64)  # sums 0; one rank, divisor 1
    assert window.empty and torch.equal(window.packed("cpu"), expected)
