"""A learning-rate multiplier that coexists with the user's LR schedulers (torch only, no Lightning).

Adapting the batch size means scaling the LR (linear or square-root rule) and ramping up to it. Writing
``param_group["lr"]`` alone would be undone by the next ``scheduler.step()`` of a closed-form scheduler
(``LambdaLR``, ``CosineAnnealingLR``, ... recompute from ``base_lrs``). Scaling the group's ``lr`` and
``initial_lr`` *and* every scheduler's ``base_lrs`` by the same ratio keeps closed-form and chained
schedulers consistent, and both live in the optimizer/scheduler state, so checkpoints stay consistent too.
"""

from __future__ import annotations

from typing import Iterable

import torch


def rescale_learning_rates(optimizer: torch.optim.Optimizer, schedulers: Iterable[object], ratio: float) -> None:
    """Multiply every param group's ``lr`` (and ``initial_lr``) and the schedulers' ``base_lrs`` by ``ratio``."""
    if ratio == 1.0:
        return
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * ratio
        if "initial_lr" in group:
            group["initial_lr"] = group["initial_lr"] * ratio
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is not optimizer:
            continue
        if hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [lr * ratio for lr in scheduler.base_lrs]
        if hasattr(scheduler, "_last_lr"):  # what get_last_lr() reports (and LearningRateMonitor logs)
            scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
