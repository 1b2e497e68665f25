"""The learning rate for the recommended batch and the warmup to reach it (the policy around :mod:`.rules`).

The rule comes from ``lr_rule=`` when given (a user override), else from the optimizer's family
(:func:`~gns_callback.recommendation.rules.lr_rule_for`). A warmup ramps linearly from the current LR to the new
one when the LR factor is above ``warmup_threshold`` (Goyal et al. 2017; see
:func:`~gns_callback.recommendation.rules.warmup_epochs_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gns_callback.recommendation.rules import (
    CITATIONS,
    LR_RULES,
    NONE,
    SQRT,
    OptimizerLike,
    lr_rule_for,
    optimizer_name,
    scale_lr,
    warmup_epochs_for,
)

USER_OVERRIDE = "user override"
_FAMILIES = {"linear": "SGD family", "sqrt": "adaptive (Adam) family", "none": "no rule"}
_MALLADI_NOTE = (
    "Malladi et al.'s square-root rule also scales 1−β₁, 1−β₂ by κ = B_new/B_old and ε by 1/√κ; only the LR is "
    "changed here"
)


@dataclass(frozen=True)
class LRChoice:
    """The rule applied, why (``source``), its ``citation``, the new LR (``None``: no current LR given)."""

    rule: str
    source: str
    citation: str
    learning_rate: Optional[float]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Warmup:
    """``epochs`` of linear warmup (0: none), the same in optimizer ``steps`` at the new batch (``None``: epoch
    length unknown), and ``start_factor = old_lr/new_lr`` for ``LinearLR``."""

    epochs: float
    steps: Optional[int]
    start_factor: Optional[float]
    notes: tuple[str, ...] = ()


NO_WARMUP = Warmup(0.0, 0, None)


def pick_rule(optimizer: OptimizerLike, lr_rule: Optional[str]) -> tuple[str, str, tuple[str, ...]]:
    """``(rule, source, notes)``: the override when given (checked), else the optimizer family's rule."""
    if lr_rule is not None:
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {LR_RULES}, got {lr_rule!r}")
        return lr_rule, USER_OVERRIDE, ()
    rule, unknown = lr_rule_for(optimizer)
    if unknown:
        source = "unknown optimizer: default" if rule != NONE else optimizer_name(optimizer)
        return rule, source, (unknown,)
    source = f"{_FAMILIES[rule]}: {optimizer_name(optimizer)}"
    return rule, source, ((_MALLADI_NOTE,) if rule == SQRT else ())


def choose_lr(
    current_lr: Optional[float],
    current_batch_size: int,
    batch_size: int,
    optimizer: OptimizerLike,
    lr_rule: Optional[str],
) -> LRChoice:
    """The current LR scaled from ``current_batch_size`` to ``batch_size`` by the chosen rule."""
    rule, source, notes = pick_rule(optimizer, lr_rule)
    citation = CITATIONS[rule] if source != USER_OVERRIDE else f"{USER_OVERRIDE} ({CITATIONS[rule]})"
    new_lr = None if current_lr is None else scale_lr(current_lr, current_batch_size, batch_size, rule)
    return LRChoice(rule, source, citation, new_lr, notes)


def plan_warmup(
    current_lr: Optional[float],
    new_lr: Optional[float],
    batch_size: int,
    examples_per_epoch: Optional[float],
    *,
    threshold: float,
    warmup_epochs: float,
) -> Warmup:
    """Warmup for the LR factor ``new_lr/current_lr``: epochs by :func:`warmup_epochs_for`, steps at ``batch_size``."""
    factor = new_lr / current_lr if (new_lr is not None and current_lr) else 1.0
    epochs = warmup_epochs_for(factor, threshold=threshold, warmup_epochs=warmup_epochs)
    if epochs <= 0:
        return NO_WARMUP
    start = current_lr / new_lr
    if examples_per_epoch is None:
        note = f"warmup of {epochs:.3g} epochs advised: pass dataset_size or steps_per_epoch for steps"
        return Warmup(epochs, None, start, (note,))
    return Warmup(epochs, max(1, math.ceil(epochs * examples_per_epoch / batch_size)), start)
