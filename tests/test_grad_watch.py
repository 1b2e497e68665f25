"""``GradientWatch`` (gns_callback/grad_watch.py): gradients changed between the end of backward and the read."""

import pytest
import torch
import torch.nn as nn

from gns_callback.backward_passes import measurement_paused
from gns_callback.grad_watch import (CLEARED, PROBLEM, STALE, STALE_CHECKS, STILL_SCALED, GradientWatch,
                                     StaleGradients, Verdict)
from tests.helpers import mlp


def backward(net: nn.Module, scale: float = 1.0) -> None:
    net.zero_grad()
    (net(torch.randn(4, 64)).square().mean() * scale).backward()


def test_it_watches_the_smallest_parameters():
    net = mlp()
    assert [p.numel() for p in GradientWatch(list(net.parameters())).params] == [10, 32]


def test_a_change_after_backward_is_a_problem_and_none_is_not():
    net = mlp()
    watch = GradientWatch(list(net.parameters()))
    backward(net)
    watch.mark()
    assert watch.problem() is None
    watch.mark()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e-3)  # the user's clipping after backward
    assert watch.problem() == PROBLEM
    assert watch.problem() is None  # the mark is forgotten once checked


def marked(net: nn.Module) -> GradientWatch:
    watch = GradientWatch(list(net.parameters()))
    backward(net)
    watch.mark()
    return watch


def test_a_change_to_one_large_gradient_only_is_a_problem():
    net = mlp()
    watch = marked(net)
    net[0].weight.grad[:16] = 0  # half the first layer's units frozen by hand; the watched norms don't see it
    assert watch.problem() == PROBLEM


def test_a_replaced_or_dropped_gradient_is_a_problem():
    net = mlp()
    watch = marked(net)
    net[0].weight.grad = net[0].weight.grad.clone()
    assert watch.problem() == PROBLEM
    watch = marked(net)
    net[0].weight.grad = None
    assert watch.problem() == PROBLEM


def test_a_change_through_data_is_caught_by_the_norms_where_it_reaches_them():
    net = mlp()
    watch = marked(net)
    for p in net.parameters():
        p.grad.data.mul_(0.5)  # .data bypasses the version counter
    assert watch.problem() == PROBLEM


def test_accumulating_more_backward_passes_before_the_step_is_no_change():
    net = mlp()
    watch = marked(net)
    (net(torch.randn(4, 64)).square().mean()).backward()  # the next micro-batch adds to .grad in place...
    watch.mark()  # ...and its end of backward is marked again
    assert watch.problem() is None


def test_under_a_loss_scale_a_change_to_some_gradients_is_still_a_problem():
    net = mlp()
    watch = marked(net)
    for p in net.parameters():
        p.grad.mul_(2.0**-16)  # the scaler's unscaling, even if it bumped every version alike
    net[0].weight.grad[:16] = 0
    assert watch.problem(loss_scale=2.0**16) == PROBLEM


def test_under_a_loss_scale_every_gradient_changed_alike_is_left_to_the_norms():
    net = mlp()
    net[0].bias.requires_grad_(False)
    watch = GradientWatch([p for p in net.parameters()])
    backward(net, scale=2.0**16)
    watch.mark()
    for p in net.parameters():
        if p.grad is not None:
            p.grad.mul_(2.0**-16)  # an unscaling that bumps every version (torch 2.13's does not)
    assert watch.problem(loss_scale=2.0**16) is None  # a parameter without a gradient changes nothing


def test_the_amp_loss_scale_taken_off_in_between_is_no_change():
    net = mlp()
    watch = GradientWatch(list(net.parameters()))
    backward(net, scale=2.0**16)
    watch.mark()
    for p in net.parameters():
        p.grad.mul_(2.0**-16)  # GradScaler.unscale_
    assert watch.problem(loss_scale=torch.tensor(2.0**16)) is None


def test_a_step_the_scaler_skips_is_no_change():
    net = mlp()
    watch = GradientWatch(list(net.parameters()))
    backward(net)
    for p in net.parameters():
        p.grad.fill_(float("inf"))
    watch.mark()
    for p in net.parameters():
        p.grad.fill_(float("nan"))  # what the scaler's unscaling makes of an overflow
    assert watch.problem(loss_scale=2.0**16) is None


def test_nothing_marked_nothing_checked():
    net = mlp()
    backward(net)
    assert GradientWatch(list(net.parameters())).problem() is None


def passes(net: nn.Module, count: int) -> None:
    for _ in range(count):
        (net(torch.randn(4, 64)).square().mean()).backward()


def test_a_step_whose_first_pass_found_a_gradient_is_stale():
    net = mlp()
    stale = StaleGradients(GradientWatch(list(net.parameters())).params[0])  # the smallest, as the meter watches
    assert stale.param.numel() == 10
    passes(net, 2)  # one step of two passes into cleared gradients: fine
    assert stale.problem() is None
    passes(net, 1)  # the next step, with the last one's gradient still in .grad
    assert stale.problem() == STALE


def test_cleared_or_zeroed_gradients_and_passes_that_fill_no_grad_are_not_stale():
    net = mlp()
    stale = StaleGradients(GradientWatch(list(net.parameters())).params[0])  # the smallest, as the meter watches
    for set_to_none in (True, False, True):
        net.zero_grad(set_to_none=set_to_none)
        passes(net, 2)
        assert stale.problem() is None
    x = torch.randn(4, 64, requires_grad=True)
    torch.autograd.grad(net(x).sum(), list(net.parameters()))  # a gradient penalty's pass, say: not a step's
    with measurement_paused():
        passes(net, 1)  # a probe's pass
    net.zero_grad()
    passes(net, 1)
    assert stale.problem() is None


def test_the_check_comes_off_after_its_steps():
    net = mlp()
    stale = StaleGradients(GradientWatch(list(net.parameters())).params[0])  # the smallest, as the meter watches
    for _ in range(STALE_CHECKS):
        net.zero_grad()
        passes(net, 1)
        assert stale.problem() is None
    passes(net, 1)  # stale now, but no longer looked at: no hook, no host read
    assert stale.problem() is None and not stale.param._backward_hooks


def test_a_change_to_every_gradient_alike_is_judged_by_the_total_norm_the_read_takes():
    """``clip_grad_norm_`` multiplies every gradient, by 1 where it does not clip: the versions all move alike, and
    what the read takes from ``.grad`` (``|G_B|²``) is unchanged. The total is kept at the first mark, and at every
    mark after such a change; a step without one stops keeping it."""
    net = mlp()
    watch = marked(net)
    assert watch._totals is not None
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1e6)  # multiplies by 1
    assert watch.problem() is None and watch.keep_total
    for max_norm, verdict in ((1e6, None), (1e-3, PROBLEM)):
        backward(net)
        watch.mark()
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        assert watch.problem() == verdict
    backward(net)
    watch.mark()
    assert watch.problem() is None and not watch.keep_total
    watch.mark()
    assert watch._totals is None


def test_a_change_alike_seen_without_a_total_is_judged_by_the_watched_norms():
    net = mlp()
    watch = marked(net)
    assert watch.problem() is None and not watch.keep_total
    backward(net)
    watch.mark()
    for p in net.parameters():
        p.grad.mul_(0.5)
    assert watch.problem() == PROBLEM and watch.keep_total


def test_a_loss_scale_given_to_gradients_still_scaled_says_so():
    net = mlp()
    watch = GradientWatch(list(net.parameters()))
    backward(net, scale=2.0**10)
    watch.mark()
    assert watch.problem(loss_scale=2.0**10) == STILL_SCALED


def test_cleared_gradients_say_so():
    for set_to_none in (True, False):
        net = mlp()
        watch = marked(net)
        net.zero_grad(set_to_none=set_to_none)
        assert watch.problem() == CLEARED


def test_in_one_process_a_change_is_answered_with_the_totals_backward_left():
    """``read_at_mark``: whatever the change, the read takes ``|G_B|²`` as backward left it; a change with no total
    kept (the loop left the gradients alone on the step before) is skipped."""
    net = mlp()
    watch = GradientWatch(list(net.parameters())[:2], list(net.parameters())[2:], read_at_mark=True)
    backward(net)
    watch.mark()
    measured = sum(float(p.grad.square().sum()) for p in list(net.parameters())[:2])
    left_out = sum(float(p.grad.square().sum()) for p in list(net.parameters())[2:])
    net[0].weight.grad[:16] = 0  # part of one layer
    verdict = watch.verdict()
    assert verdict.problem is None and not verdict.skip
    assert [float(t) for t in verdict.totals] == pytest.approx([measured, left_out], rel=1e-6)
    backward(net)
    watch.mark()
    assert watch.verdict() == Verdict() and not watch.keep_total  # nothing changed: no total kept from now
    backward(net)
    watch.mark()
    net[2].bias.grad.mul_(0.5)
    assert watch.verdict() == Verdict(skip=True)
