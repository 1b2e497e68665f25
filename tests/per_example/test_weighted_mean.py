"""The watch for losses averaged over the batch's own class weights or its targets not ignored
(``gns_callback/per_example/weighted_mean.py``): which calls it reports, that it leaves every value as it was, and
what the plain meter does with it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gns_callback import GradientNoiseScaleMeter
from gns_callback.per_example.weighted_mean import WeightedMeanWatch
from tests.helpers import assert_matches_exact, mlp

WEIGHTS = torch.tensor([0.1, 0.2, 0.3, 0.5, 1.0, 1.0, 2.0, 3.0, 5.0, 10.0])


def _logits_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 10, generator=generator, requires_grad=True), torch.randint(0, 10, (8,), generator=generator)


@pytest.mark.parametrize("loss, found", [
    (lambda z, y: nn.CrossEntropyLoss(weight=WEIGHTS)(z, y), "cross_entropy"),
    (lambda z, y: F.cross_entropy(z, y, WEIGHTS), "cross_entropy"),
    (lambda z, y: nn.NLLLoss(weight=WEIGHTS)(z.log_softmax(1), y), "nll_loss"),
    (lambda z, y: F.nll_loss(z.log_softmax(1), y, WEIGHTS, None, -100, None), "nll_loss"),  # legacy flags unset
    (lambda z, y: F.cross_entropy(z, y, weight=WEIGHTS, label_smoothing=0.1), "cross_entropy"),
    (lambda z, y: F.cross_entropy(z, y, weight=WEIGHTS, reduction="sum") / 8, None),  # a constant divisor
    (lambda z, y: F.cross_entropy(z, y, weight=WEIGHTS, reduction="none").mean(), None),
    (lambda z, y: F.cross_entropy(z, y, weight=torch.full((10,), 2.0)), None),  # equal weights: Σ w = 2B
    (lambda z, y: F.cross_entropy(z, y), None),
    (lambda z, y: F.cross_entropy(z, F.one_hot(y, 10).float() * 0.9 + 0.01, weight=WEIGHTS), None),  # probabilities
    (lambda z, y: F.binary_cross_entropy_with_logits(z, F.one_hot(y, 10).float(), weight=WEIGHTS), None),
])
def test_the_watch_reports_a_divisor_that_moves_with_the_batch_and_changes_no_value(loss, found):
    z, y = _logits_and_targets()
    with WeightedMeanWatch() as watch:
        watched = loss(z, y)
    assert watch.found == found
    assert torch.equal(watched, loss(z, y))


def _padded(lengths: list[int], pad: int = -100) -> torch.Tensor:
    """Targets of 4 examples of 6 positions, each keeping its first ``lengths[i]``."""
    targets = torch.arange(24).reshape(4, 6) % 10
    targets[torch.arange(6)[None, :] >= torch.tensor(lengths)[:, None]] = pad
    return targets


def _token_logits() -> torch.Tensor:
    return torch.randn(4, 6, 10, generator=torch.Generator().manual_seed(1), requires_grad=True)


@pytest.mark.parametrize("loss, found", [
    (lambda z, t: F.cross_entropy(z.reshape(-1, 10), t.reshape(-1)), "cross_entropy"),  # flattened, as HF does
    (lambda z, t: F.cross_entropy(z.transpose(1, 2), t), "cross_entropy"),  # (B, C, T) against (B, T)
    (lambda z, t: nn.CrossEntropyLoss()(z.transpose(0, 1).reshape(-1, 10), t.T.reshape(-1)), "cross_entropy"),
    (lambda z, t: F.cross_entropy(z.permute(1, 2, 0), t.T), "cross_entropy"),  # sequence-first: (T, C, B)
    (lambda z, t: F.nll_loss(z.log_softmax(-1).reshape(-1, 10), t.reshape(-1)), "nll_loss"),
    (lambda z, t: F.cross_entropy(z.reshape(-1, 10), t.reshape(-1), label_smoothing=0.1), "cross_entropy"),
    (lambda z, t: F.cross_entropy(z.reshape(-1, 10), t.reshape(-1), reduction="sum") / 12, None),
    (lambda z, t: F.cross_entropy(z.reshape(-1, 10), torch.where(t < 0, 9, t).reshape(-1), ignore_index=9),
     "cross_entropy"),  # padded with an index of its own
])
def test_the_watch_reports_a_mean_over_targets_kept_unequally_by_the_examples(loss, found):
    z, targets = _token_logits(), _padded([6, 2, 4, 1])
    with WeightedMeanWatch(batch_size=4) as watch:
        watched = loss(z, targets)
    assert (watch.found, watch.divides_by) == (found, found and "the batch's count of targets not equal to "
                                                                  "ignore_index")
    assert torch.equal(watched, loss(z, targets))


@pytest.mark.parametrize("lengths, batch_size, found", [
    ([6, 6, 6, 6], 4, None),  # nothing ignored
    ([3, 3, 3, 3], 4, None),  # as many kept by every example: a constant divisor (a prompt of fixed length)
    ([3, 3, 3, 2], 4, "cross_entropy"),
    ([3, 3, 3, 3], None, "cross_entropy"),  # the examples can't be told: any ignored target counts
    ([3, 3, 3, 3], 5, "cross_entropy"),  # 24 targets don't fall into 5 examples
])
def test_equal_counts_per_example_are_a_constant_divisor(lengths, batch_size, found):
    z, targets = _token_logits(), _padded(lengths)
    with WeightedMeanWatch(batch_size=batch_size) as watch:
        F.cross_entropy(z.reshape(-1, 10), targets.reshape(-1))
    assert watch.found == found


def test_an_ignored_example_of_one_target_each_is_reported():
    """One target per example, some unlabelled (``-100``): the mean divides by the batch's labelled count."""
    z, y = _logits_and_targets()
    y[::3] = -100
    with WeightedMeanWatch(batch_size=8) as watch:
        F.cross_entropy(z, y)
    assert watch.found == "cross_entropy"


def test_a_weighted_loss_only_logged_is_not_reported():
    z, y = _logits_and_targets()
    with WeightedMeanWatch() as watch:
        with torch.no_grad():
            F.cross_entropy(z, y, weight=WEIGHTS)
        F.cross_entropy(z.detach(), y, weight=WEIGHTS)
    assert watch.found is None


def _weighted_steps(meter: GradientNoiseScaleMeter, net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for start in range(0, 96, 32):
        F.cross_entropy(net(x[start:start + 32]), y[start:start + 32], weight=WEIGHTS).backward()
        meter.step()
        net.zero_grad()


@pytest.mark.parametrize("fallback", [None, "micro_batch"])
def test_the_meter_stops_with_the_fix_and_does_not_switch(digits, fallback):
    """Before, the digits MLP with these weights read 16.8–17.1 with intervals of ±6%, against 13.9 for its weighted
    examples and 11.1 for the batch gradient's own noise (benchmarks/RESULTS.md); a micro-batch's weighted mean is a
    ratio too, so the fallback would read another value again (16.1 at micro-batches of 8)."""
    x, y = digits
    net = mlp()
    with GradientNoiseScaleMeter(net, fallback_method=fallback) as meter:
        check = meter.check_per_example(lambda: F.cross_entropy(net(x[:32]), y[:32], weight=WEIGHTS).backward(), 32)
        assert check.status == "weighted mean" and check.refused
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _weighted_steps(meter, net, x, y)
    said = [str(w.message) for w in caught if "gns_callback" in str(w.message)]
    assert len(said) == 1 and "stopped measuring" in said[0] and "reduction='sum'" in said[0], said
    assert meter.method == "per_example" and not meter.run_estimate.measured
    assert "class weights" in meter.run_estimate.failure


def test_the_meter_stops_at_a_mean_over_padded_tokens_with_the_fix(digits):
    """A digits token model whose examples keep 8 targets for class 0 and 1 otherwise (the rest ``-100``). Before, it
    read B_simple = 18.2–19.7 (95% CIs about ±10%) against 13.4 for its examples' token sums and 9.3 for the batch
    gradient's own noise at 32 (18.1 at 8), 0 of 5 intervals holding either (``python
    benchmarks/batch_normalised_losses.py``, RESULTS.md)."""
    from benchmarks.batch_normalised_losses import TokenNet, token_loss, token_targets

    x, y = digits
    tokens, targets = x.reshape(-1, 8, 8), token_targets(y, torch.where(y == 0, 8, 1))
    net = TokenNet()
    with GradientNoiseScaleMeter(net, fallback_method="micro_batch") as meter:
        check = meter.check_per_example(lambda: token_loss(net, tokens[:32], targets[:32]).backward(), 32)
        assert check.status == "weighted mean" and "ignore_index" in check.detail
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for start in range(0, 96, 32):
                token_loss(net, tokens[start:start + 32], targets[start:start + 32]).backward()
                meter.step()
                net.zero_grad()
    said = [str(w.message) for w in caught if "gns_callback" in str(w.message)]
    assert len(said) == 1 and "stopped measuring" in said[0] and "reduction='sum'" in said[0], said
    assert meter.method == "per_example" and not meter.run_estimate.measured
    assert "targets not ignored" in meter.run_estimate.failure


def test_the_fix_a_constant_divisor_is_measured_against_the_exact_value(digits, exact_gns):
    """The fix the reason gives: the same weights over a constant, ``reduction="sum"`` / (batch · mean weight)."""
    x, y = digits
    net = mlp()
    exact = exact_gns(net, lambda out, t: F.cross_entropy(out, t, weight=WEIGHTS, reduction="sum"), x, y)[0]
    divisor = 32 * float(WEIGHTS[y].mean())
    generator = torch.Generator().manual_seed(0)
    with GradientNoiseScaleMeter(net) as meter:
        i = torch.randint(0, len(x), (32,), generator=generator)
        check = meter.check_per_example(
            lambda: (F.cross_entropy(net(x[i]), y[i], weight=WEIGHTS, reduction="sum") / divisor).backward(), 32)
        assert check.status == "independent", check
        for _ in range(300):
            i = torch.randint(0, len(x), (32,), generator=generator)
            (F.cross_entropy(net(x[i]), y[i], weight=WEIGHTS, reduction="sum") / divisor).backward()
            meter.step()
            net.zero_grad()
    assert_matches_exact(meter.run_estimate, exact)
