"""Rescaled learning rates survive the user's LR schedulers (closed-form and chained)."""

import pytest
import torch

from gns_callback.lr_multiplier import SCALABLE_SCHEDULERS, rescale_learning_rates, unscalable_schedulers

S = torch.optim.lr_scheduler


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


#: One instance of every scheduler in SCALABLE_SCHEDULERS, with absolute LRs of their own where they take them.
SCHEDULERS = {
    "LambdaLR": lambda opt: S.LambdaLR(opt, lambda step: 1.0 / (1 + step)),  # closed form
    "MultiplicativeLR": lambda opt: S.MultiplicativeLR(opt, lambda step: 0.9),
    "StepLR": lambda opt: S.StepLR(opt, step_size=2, gamma=0.5),  # chained
    "MultiStepLR": lambda opt: S.MultiStepLR(opt, milestones=[2, 5], gamma=0.3),
    "ConstantLR": lambda opt: S.ConstantLR(opt, factor=0.5, total_iters=4),
    "LinearLR": lambda opt: S.LinearLR(opt, start_factor=0.2, total_iters=6),
    "ExponentialLR": lambda opt: S.ExponentialLR(opt, gamma=0.8),
    "PolynomialLR": lambda opt: S.PolynomialLR(opt, total_iters=10, power=2.0),
    "CosineAnnealingLR": lambda opt: S.CosineAnnealingLR(opt, T_max=10, eta_min=0.02),
    "CosineAnnealingWarmRestarts": lambda opt: S.CosineAnnealingWarmRestarts(opt, T_0=4, eta_min=0.01),
    "CyclicLR": lambda opt: S.CyclicLR(opt, base_lr=0.01, max_lr=0.2, step_size_up=3, cycle_momentum=False),
    "OneCycleLR": lambda opt: S.OneCycleLR(opt, max_lr=0.5, total_steps=20),
    "ReduceLROnPlateau": lambda opt: S.ReduceLROnPlateau(opt, factor=0.5, patience=0, min_lr=0.03),
    "SequentialLR": lambda opt: S.SequentialLR(
        opt, [S.LinearLR(opt, start_factor=0.1, total_iters=3), S.CosineAnnealingLR(opt, T_max=8, eta_min=0.01)],
        milestones=[3]),
    "ChainedScheduler": lambda opt: S.ChainedScheduler(
        [S.ConstantLR(opt, factor=0.5, total_iters=5), S.ExponentialLR(opt, gamma=0.9)]),
}


def _step(scheduler):
    if isinstance(scheduler, S.ReduceLROnPlateau):
        scheduler.step(1.0)  # a metric that never improves: the LR falls to min_lr
    else:
        scheduler.step()


def test_every_scalable_scheduler_is_tested():
    assert {cls.__name__ for cls in SCALABLE_SCHEDULERS} == set(SCHEDULERS)


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
@pytest.mark.parametrize("at_step", [0, 3, 7])
def test_rescaled_lr_follows_the_schedule(name, at_step):
    """After ×3 at ``at_step``, every later LR is exactly 3× what the same schedule gives without the change
    (OneCycleLR's max_lr/min_lr, CyclicLR's max_lrs, eta_min and min_lrs included; 20 steps cover the warm
    restarts, the cycles, the one cycle and the plateau floor)."""
    plain_opt, scaled_opt = _optimizer(), _optimizer()
    plain, scaled = SCHEDULERS[name](plain_opt), SCHEDULERS[name](scaled_opt)
    for step in range(20):
        if step == at_step:
            rescale_learning_rates(scaled_opt, [scaled], 3.0)
        if step >= at_step:
            assert scaled_opt.param_groups[0]["lr"] == pytest.approx(3.0 * plain_opt.param_groups[0]["lr"]), step
            assert scaled.get_last_lr() == pytest.approx([3.0 * lr for lr in plain.get_last_lr()]), step
        for opt, sched in ((plain_opt, plain), (scaled_opt, scaled)):
            opt.step()
            _step(sched)


class Halving(S.LambdaLR):
    """A user's own subclass: may compute LRs of its own, so it is not taken on trust."""


def test_unscalable_schedulers_are_named_nested_ones_too():
    opt = _optimizer()
    own = Halving(opt, lambda step: 0.5)
    assert unscalable_schedulers([S.StepLR(opt, 2), own]) == ["Halving"]
    assert unscalable_schedulers([S.SequentialLR(opt, [S.StepLR(opt, 2), Halving(opt, lambda s: 1.0)], [2])]) == [
        "Halving"]


def test_ratio_one_changes_nothing_and_other_optimizers_schedulers_are_left_alone():
    opt, other = _optimizer(), _optimizer()
    sched_other = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    rescale_learning_rates(opt, [sched_other], 1.0)
    rescale_learning_rates(opt, [sched_other], 2.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.2)
    assert sched_other.base_lrs == [0.1] and other.param_groups[0]["lr"] == 0.1
    assert sched_other.get_last_lr() == [0.1]


def test_get_last_lr_reports_the_rescaled_value():
    opt = _optimizer()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5)
    rescale_learning_rates(opt, [sched], 4.0)
    assert sched.get_last_lr() == [pytest.approx(0.4)]
