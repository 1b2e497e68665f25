"""AccumulationWindow + step_estimates on deterministic inputs."""

import pytest
import torch

from gns_callback.accumulation import SCALE_MARGIN, AccumulationWindow, scale_mismatch, step_estimates
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
    expected = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0], dtype=torch.float64)  # sums 0; one rank, divisor 1
    assert window.empty and torch.equal(window.packed("cpu"), expected)


def _example_window(passes, measured, reduction):
    """A window of example units as the per-example collector fills it (gradients already in per-example units)."""
    window = AccumulationWindow(loss_divisor=len(passes))
    for g, k in zip(passes, measured):
        unmeasured = g[k:].sum(0).pow(2).sum()
        window.add_micro_batch(g[:k].pow(2).sum(), float(k), float(k), g.shape[0], unmeasured_sq=unmeasured)
    n, total = len(passes), sum(g.shape[0] for g in passes)
    weights = [1.0 / (n * g.shape[0]) if reduction == "mean" else 1.0 / total for g in passes]
    big = sum(w * g.sum(0) for w, g in zip(weights, passes))  # the big batch's mean gradient
    to_step = 1.0 if reduction == "mean" else total / n  # the optimizer's .grad (each pass's loss divided by n)
    return window, big * to_step, weights


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_example_units_average_every_distinct_pair_but_the_unmeasured_blocks(reduction):
    """|G|² = Σ w_i w_l g_i·g_l / Σ w_i w_l over ordered pairs i ≠ l, leaving out pairs of two unmeasured examples of
    the same micro-batch (brute force over pairs); tr Σ = mean of the measured |g_i|² minus it."""
    torch.manual_seed(0)
    passes = [torch.randn(b, 3, dtype=torch.float64) + 0.5 for b in (5, 3, 4)]
    measured = [2, 3, 1]
    window, step_grad, weights = _example_window(passes, measured, reduction)
    trace, grad_sq, valid = step_estimates(window.packed(), step_grad.pow(2).sum(), reduction)
    rows = [(j, r, passes[j][r], weights[j]) for j in range(3) for r in range(passes[j].shape[0])]
    numerator = denominator = 0.0
    for j, r, g, w in rows:
        for j2, r2, g2, w2 in rows:
            both_unmeasured = j == j2 and r >= measured[j] and r2 >= measured[j]
            if (j, r) != (j2, r2) and not both_unmeasured:
                numerator += w * w2 * float(g @ g2)
                denominator += w * w2
    mean_sq = sum(float(g[:k].pow(2).sum()) for g, k in zip(passes, measured)) / sum(measured)
    assert valid
    assert grad_sq.item() == pytest.approx(numerator / denominator, rel=1e-10)
    assert trace.item() == pytest.approx(mean_sq - numerator / denominator, rel=1e-10)


def test_every_example_measured_is_the_u_statistic():
    torch.manual_seed(1)
    g = torch.randn(6, 4, dtype=torch.float64)
    window, big, _ = _example_window([g], [6], "mean")
    trace, grad_sq, _ = step_estimates(window.packed(), big.pow(2).sum())
    torch.testing.assert_close(trace, g.var(0, unbiased=True).sum())
    torch.testing.assert_close(grad_sq, (g.sum(0).pow(2).sum() - g.pow(2).sum()) / 30)


def test_example_units_are_unbiased_for_a_subset():
    """Averaged over many i.i.d. batches, a subset's estimates match the population's |G|² and tr Σ (tolerance from
    the standard error of the mean)."""
    gen = torch.Generator().manual_seed(2)
    population = torch.randn(50, 3, dtype=torch.float64, generator=gen) * torch.tensor([1.0, 2.0, 0.5]) + 0.3
    mean = population.mean(0)
    exact_grad_sq, exact_trace = float(mean @ mean), float((population - mean).pow(2).sum(1).mean())
    values = []
    for _ in range(4000):
        batch = population[torch.randint(0, 50, (8,), generator=gen)]
        window, big, _ = _example_window([batch], [3], "mean")
        trace, grad_sq, _ = step_estimates(window.packed(), big.pow(2).sum())
        values.append((float(trace), float(grad_sq)))
    values = torch.tensor(values, dtype=torch.float64)
    for column, exact in ((0, exact_trace), (1, exact_grad_sq)):
        se = values[:, column].std() / len(values) ** 0.5
        assert abs(values[:, column].mean() - exact) < 4 * se


def test_example_units_summed_over_ranks_match_one_process_accumulating():
    """Data parallel: each rank's window packed and summed (the all-reduce) gives the estimates of one process
    accumulating the same micro-batches, subsets included."""
    torch.manual_seed(3)
    passes = [torch.randn(6, 4, dtype=torch.float64) + 0.2 for _ in range(2)]
    one, step_grad, _ = _example_window(passes, [2, 2], "mean")
    summed = sum(_example_window([g], [2], "mean")[0].packed() for g in passes)
    for a, b in zip(step_estimates(one.packed(), step_grad.pow(2).sum()), step_estimates(summed, step_grad.pow(2).sum())):
        torch.testing.assert_close(a, b)


def _random_window(gen: torch.Generator, passes: int, subset: bool) -> AccumulationWindow:
    window = AccumulationWindow(loss_divisor=passes)
    for _ in range(passes):
        size = int(torch.randint(2, 40, (), generator=gen))
        measured = int(torch.randint(1, size + 1, (), generator=gen)) if subset else size
        sq = torch.rand((), generator=gen) * 10
        window.add_micro_batch(sq, float(measured), float(measured), size, weight=float(torch.rand((), generator=gen)),
                               unmeasured_sq=torch.rand((), generator=gen) if subset else None)
    return window


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("passes, subset", [(1, False), (1, True), (3, False), (4, True)])
def test_host_values_give_the_tensor_estimates(reduction, passes, subset):
    """The CPU fast path (``packed_values`` + host scalars) is the tensor path's arithmetic: bit for bit with one
    backward pass; with several, the sums over passes may round differently (a BLAS dot's order), by an ulp."""
    gen = torch.Generator().manual_seed(passes + 10 * subset)
    rel = 0.0 if passes == 1 else 1e-14
    for _ in range(20):
        window = _random_window(gen, passes, subset)
        big = torch.rand((), generator=gen)
        packed = window.packed(loss_scale=torch.tensor(8.0))
        assert window.packed_values(loss_scale=torch.tensor(8.0)) == pytest.approx(packed.tolist(), rel=rel, abs=0)
        device = step_estimates(packed, big, reduction)
        host = step_estimates(window.packed_values(loss_scale=torch.tensor(8.0)), float(big), reduction)
        assert [float(v) for v in host[:2]] == pytest.approx([v.item() for v in device[:2]], rel=1e3 * rel, abs=0)
        assert bool(host[2]) == device[2].item()


def test_host_values_give_inf_and_invalid_where_tensors_do():
    """A division by zero (equal batch sizes, an empty window) is ``inf``/``nan`` and an invalid step, not an error."""
    window = AccumulationWindow()
    window.add_micro_batch(torch.tensor(5.0), 4.0, 1.0, 4)
    host, device = step_estimates(window.packed_values(), 1.0), step_estimates(window.packed(), torch.tensor(1.0))
    assert not host[2] and not device[2].item()
    assert str(float(host[0])) == str(device[0].item())
    empty = step_estimates(AccumulationWindow().packed_values(), 0.0)
    assert not empty[2]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_the_mean_gradient_never_exceeds_its_units_and_a_scale_between_them_shows(reduction):
    """Jensen: |Ĝ_B|² ≤ the mean of the units' |ĝ_j|², whatever the gradients (here nearly equal ones, the tightest
    case, in several passes). The step's gradient read 2³² too large (an AMP scale left on it) is far above the
    margin; a window with a subset measured is not judged."""
    torch.manual_seed(3)
    passes = [torch.randn(b, 5, dtype=torch.float64) * 0.01 + 1.0 for b in (4, 4, 3)]
    window, step_grad, _ = _example_window(passes, [4, 4, 3], reduction)
    packed, step_sq = window.packed().tolist(), float(step_grad.pow(2).sum())
    assert 0.99 < scale_mismatch(packed, step_sq, reduction) <= 1.0
    assert scale_mismatch(packed, step_sq * 2.0**32, reduction) > SCALE_MARGIN
    subset, step_grad, _ = _example_window(passes, [2, 4, 3], reduction)
    assert scale_mismatch(subset.packed().tolist(), float(step_grad.pow(2).sum()) * 2.0**32, reduction) == 0.0
