"""Rescaled learning rates survive the user's LR schedulers (closed-form and chained)."""

import pytest
import torch

from gns_callback.lr_multiplier import rescale_learning_rates


def _optimizer():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


@pytest.mark.parametrize(
    "make_scheduler",
    [
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),  # closed form
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),  # chained
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    ],
)
def test_rescaled_lr_follows_the_schedule(make_scheduler):
    """After ×3 at step 3, every later LR is 3× what the same schedule gives without the change."""
    plain_opt, scaled_opt = _optimizer(), _optimizer()
    plain, scaled = make_scheduler(plain_opt), make_scheduler(scaled_opt)
    for step in range(8):
        if step == 3:
            rescale_learning_rates(scaled_opt, [scaled], 3.0)
        if step >= 3:
            assert scaled_opt.param_groups[0]["lr"] == pytest.approx(3.0 * plain_opt.param_groups[0]["lr"])
        for opt, sched in ((plain_opt, plain), (scaled_opt, scaled)):
            opt.step()
            sched.step()


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
