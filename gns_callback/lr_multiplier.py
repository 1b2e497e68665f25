"""A learning-rate multiplier that coexists with the user's LR schedulers (torch only, no Lightning).

Adapting the batch size means scaling the LR (linear or square-root rule) and ramping up to it. Writing
``param_group["lr"]`` alone would be undone by the next ``scheduler.step()`` of a closed-form scheduler
(``LambdaLR``, ``CosineAnnealingWarmRestarts``, ... recompute from ``base_lrs``), and schedulers that hold absolute
LRs of their own would pull the LR back to them: ``OneCycleLR`` anneals between the param groups' ``max_lr`` and
``min_lr`` (scaling only ``lr`` applied ×1.18 where ×8 was reported), ``CyclicLR`` between ``base_lrs`` and
``max_lrs``, the cosine schedulers towards ``eta_min``, ``ReduceLROnPlateau`` down to ``min_lrs``. Scaling every one
of these by the same ratio (recursively inside ``SequentialLR``/``ChainedScheduler``) makes the whole schedule from
then on exactly ``ratio`` times what it would have been. Everything scaled lives in the optimizer/scheduler state,
so checkpoints stay consistent too.

Only the schedulers in :data:`SCALABLE_SCHEDULERS` are known to follow (``tests/test_lr_multiplier.py`` checks
each one's trajectory); :func:`unscalable_schedulers` names the others, which callers should refuse.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.optim import lr_scheduler as schedulers_module

#: Param-group entries holding absolute LRs (``OneCycleLR`` keeps its ``max_lr``/``min_lr`` there).
_GROUP_LRS = ("lr", "initial_lr", "max_lr", "min_lr")
#: Scheduler attributes holding absolute LRs (a number or one per param group).
_SCHEDULER_LRS = ("base_lrs", "max_lrs", "min_lrs", "eta_min", "default_min_lr")

#: Exact types whose LR trajectory :func:`rescale_learning_rates` scales exactly (a subclass may override
#: ``get_lr`` with absolute values of its own, so subclasses are not matched).
SCALABLE_SCHEDULERS: tuple[type, ...] = tuple(
    getattr(schedulers_module, name)
    for name in (
        "LambdaLR", "MultiplicativeLR", "StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR",
        "PolynomialLR", "CosineAnnealingLR", "CosineAnnealingWarmRestarts", "CyclicLR", "OneCycleLR",
        "ReduceLROnPlateau", "SequentialLR", "ChainedScheduler",
    )
    if hasattr(schedulers_module, name)
)


def unscalable_schedulers(schedulers: Iterable[object]) -> list[str]:
    """Type names of the ``schedulers`` (and of those nested in them) that are not in :data:`SCALABLE_SCHEDULERS`."""
    names = []
    for scheduler in schedulers:
        if type(scheduler) not in SCALABLE_SCHEDULERS:
            names.append(type(scheduler).__name__)
        names.extend(unscalable_schedulers(getattr(scheduler, "_schedulers", [])))
    return names


def rescale_learning_rates(optimizer: torch.optim.Optimizer, schedulers: Iterable[object], ratio: float) -> None:
    """Multiply every absolute LR of ``optimizer``'s param groups and of its ``schedulers`` by ``ratio``."""
    if ratio == 1.0:
        return
    for group in optimizer.param_groups:
        for key in _GROUP_LRS:
            if key in group:
                group[key] = group[key] * ratio
    for scheduler in schedulers:
        _rescale_scheduler(scheduler, optimizer, ratio)


def _rescale_scheduler(scheduler: object, optimizer: torch.optim.Optimizer, ratio: float) -> None:
    if getattr(scheduler, "optimizer", None) is not optimizer:
        return
    for name in _SCHEDULER_LRS:
        value = getattr(scheduler, name, None)
        if isinstance(value, (list, tuple)):
            setattr(scheduler, name, [v * ratio for v in value])
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            setattr(scheduler, name, value * ratio)
    for inner in getattr(scheduler, "_schedulers", []):
        _rescale_scheduler(inner, optimizer, ratio)
    if hasattr(scheduler, "_last_lr"):  # what get_last_lr() reports (and LearningRateMonitor logs)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
