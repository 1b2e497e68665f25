"""Two-batch-size estimators against known values and a synthetic G + noise distribution."""

import math

import numpy as np
import pytest
import torch

from gns_callback.estimators import effective_batch_size, grad_sq_norm_estimate, trace_sigma_estimate


def test_formulas_invert_the_expectation_exactly():
    # E|G_b|² = |G|² + tr(Σ)/b exactly at the expectations: the estimators must return the truth.
    grad_sq, trace, b, B = 0.7, 42.0, 8, 64
    small, big = grad_sq + trace / b, grad_sq + trace / B
    assert grad_sq_norm_estimate(small, big, b, B) == pytest.approx(grad_sq, rel=1e-12)
    assert trace_sigma_estimate(small, big, b, B) == pytest.approx(trace, rel=1e-12)


def test_formulas_match_the_issue_statement():
    small, big, b, B = 3.0, 1.25, 4.0, 32.0
    assert grad_sq_norm_estimate(small, big, b, B) == pytest.approx((B * big - b * small) / (B - b))
    assert trace_sigma_estimate(small, big, b, B) == pytest.approx((small - big) / (1 / b - 1 / B))


def test_works_on_tensors_and_arrays():
    small, big = torch.tensor([3.0, 2.0]), torch.tensor([1.0, 1.5])
    assert torch.allclose(trace_sigma_estimate(small, big, 1.0, 8.0), (small - big) / (1 - 1 / 8))
    assert np.allclose(grad_sq_norm_estimate(small.numpy(), big.numpy(), 1.0, 8.0), (8 * big.numpy() - small.numpy()) / 7)


def test_effective_batch_size():
    assert effective_batch_size([8, 8, 8, 8]) == pytest.approx(32)
    assert effective_batch_size([8, 2], weights=[0.8, 0.2]) == pytest.approx(10)  # size weights -> Σb
    # Plain mean of a size-8 and a size-2 mean: 1/((1/4)(1/8 + 1/2)) = 6.4
    assert effective_batch_size([8, 2]) == pytest.approx(6.4)
    with pytest.raises(ValueError):
        effective_batch_size([])


def test_unbiased_on_synthetic_gradients_with_known_noise_scale():
    """Per-example gradients G + noise with tr(Σ) = d·σ², |G|² known: sample means within 4 standard errors."""
    rng = np.random.default_rng(0)
    d, sigma, b, k, steps = 40, 1.0, 4, 8, 4000
    G = rng.normal(size=d)
    G *= math.sqrt(0.5) / np.linalg.norm(G)  # |G|² = 0.5, tr Σ = 40, B_simple = 80
    examples = G + sigma * rng.normal(size=(steps, k, b, d))
    micro = examples.mean(axis=2)  # (steps, k, d)
    small = (micro**2).sum(-1).mean(-1)
    big = (micro.mean(axis=1) ** 2).sum(-1)
    trace = trace_sigma_estimate(small, big, b, b * k)
    grad_sq = grad_sq_norm_estimate(small, big, b, b * k)
    for values, truth in ((trace, d * sigma**2), (grad_sq, 0.5)):
        se = values.std(ddof=1) / math.sqrt(steps)
        assert abs(values.mean() - truth) < 4 * se, (values.mean(), truth, se)
    # Single steps are often negative for |G|² here (B_simple > B): the estimator must not clamp them.
    assert (grad_sq < 0).any()


def test_unequal_micro_batches_use_the_effective_size():
    """A partial window (micro sizes 8, 8, 3) stepping on the plain mean of micro means stays unbiased."""
    rng = np.random.default_rng(1)
    d, sizes, steps = 20, [8, 8, 3], 20000
    G = np.full(d, 0.3)
    means = [G + rng.normal(size=(steps, d)) / math.sqrt(s) for s in sizes]
    small = sum(s * (m**2).sum(-1) for s, m in zip(sizes, means)) / sum(sizes)
    big = (sum(means) / len(sizes)) ** 2
    big = big.sum(-1)
    b_small = sum(sizes) / len(sizes)
    b_big = effective_batch_size(sizes)
    trace = trace_sigma_estimate(small, big, b_small, b_big)
    se = trace.std(ddof=1) / math.sqrt(steps)
    assert abs(trace.mean() - d) < 4 * se
    # Naively using B = Σb (19) instead of the effective 1/Σ(w²/b) is biased by far more than the noise:
    naive = trace_sigma_estimate(small, big, b_small, float(sum(sizes)))
    assert abs(naive.mean() - d) > 10 * se
