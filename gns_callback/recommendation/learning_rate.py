"""The learning rate for the recommended batch and the warmup to reach it (the policy around :mod:`.rules`).

The rule comes from ``lr_rule=`` when given (a user override), else from the optimizer's family
(:func:`~gns_callback.recommendation.rules.lr_rule_for`): noise-aware by default, using the one ``B_noise``
passed in (the recommendation's estimate).

An SGD-family LR *increase* is bounded by the curvature: given the sharpness ``λ_max``, it stops at the stability
limit ``2(1+β)/λ_max`` (:mod:`.stability`; never below the current LR). Without it, the family's default keeps
the current LR: a tuned SGD LR already sits at that limit. Measured on digits (``benchmarks/lr_transfer_digits.py``,
MLP 64-64-10, LRs tuned at 8…512): from a tuned LR the noise-aware rule alone diverged in 12 of 15 batch
increases; capped at ``2/λ_max`` with λ_max the largest seen along the run (it peaks early in training) none
diverged and the median run took 1.2× the steps of the LR tuned at the new batch (worst 1.6×); λ_max at
initialisation or at the end never bound. Keeping the LR never diverged either (median 1.25×, worst 2.2×).
An explicit ``lr_rule=`` is applied as asked (capped only when ``sharpness`` is given).

A warmup ramps linearly from the current LR to the new one whenever the LR factor is above
``warmup_threshold`` (Goyal et al. 2017; see :func:`~gns_callback.recommendation.rules.warmup_epochs_for`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from gns_callback.recommendation.rules import (
    CITATIONS,
    NOISE_RULES,
    NONE,
    SGD_RULES,
    SMALL_BATCH_LIMIT,
    SQRT_RULES,
    OptimizerLike,
    check_rule,
    lr_factor,
    lr_rule_for,
    optimizer_name,
    warmup_epochs_for,
)
from gns_callback.recommendation.stability import Momentum, cap_increase, momentum_of, stability_limit

USER_OVERRIDE = "user override"
_FAMILIES = {"noise_linear": "SGD family", "noise_sqrt": "adaptive (Adam) family", "none": "no rule"}
_MALLADI_NOTE = (
    "Malladi et al.'s square-root rule also scales 1−β₁, 1−β₂ by κ = B_new/B_old and ε by 1/√κ; only the LR is "
    "changed here"
)


@dataclass(frozen=True)
class Ceiling:
    """The largest LR allowed at any batch (``None``: none), the SGD stability limit ``2(1+β)/λ_max`` and the
    sharpness it came from (``None`` when no sharpness was used)."""

    lr: Optional[float] = None
    stability_limit: Optional[float] = None
    sharpness: Optional[float] = None


@dataclass(frozen=True)
class LRChoice:
    """The rule applied, why (``source``), its ``citation``, the new LR (``None``: no current LR given), and the
    :class:`Ceiling` that bounded it."""

    rule: str
    source: str
    citation: str
    learning_rate: Optional[float]
    notes: tuple[str, ...]
    ceiling: Ceiling = Ceiling()


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
        return check_rule(lr_rule), USER_OVERRIDE, ()
    rule, unknown = lr_rule_for(optimizer)
    if unknown:
        source = "unknown optimizer: default" if rule != NONE else optimizer_name(optimizer)
        return rule, source, (unknown,)
    source = f"{_FAMILIES[rule]}: {optimizer_name(optimizer)}"
    return rule, source, ((_MALLADI_NOTE,) if rule in SQRT_RULES else ())


def choose_lr(
    current_lr: Optional[float],
    current_batch_size: int,
    batch_size: int,
    optimizer: OptimizerLike,
    lr_rule: Optional[str],
    *,
    b_noise: float,
    sharpness: Optional[float] = None,
) -> LRChoice:
    """The current LR moved from ``current_batch_size`` to ``batch_size`` by the chosen rule at ``b_noise``,
    then bounded by :func:`sgd_ceiling` (SGD rules only)."""
    rule, source, notes = pick_rule(optimizer, lr_rule)
    citation = CITATIONS[rule] if source != USER_OVERRIDE else f"{USER_OVERRIDE} ({CITATIONS[rule]})"
    if current_lr is None:
        return LRChoice(rule, source, citation, None, notes)
    scaled, how = transfer(current_lr, current_batch_size, batch_size, rule, b_noise)
    ceiling, why = sgd_ceiling(current_lr, rule, sharpness, optimizer, automatic=source != USER_OVERRIDE)
    new_lr = scaled if ceiling.lr is None else cap_increase(scaled, current_lr, ceiling.lr)
    held = _held_note(rule, scaled, new_lr, ceiling) if new_lr < scaled else ()
    return LRChoice(rule, source, citation, new_lr, notes + how + why + held, ceiling)


def transfer(
    lr: float, old_batch_size: int, new_batch_size: int, rule: str, b_noise: float
) -> tuple[float, tuple[str, ...]]:
    """``(new_lr, notes)``: ``lr·lr_factor(...)``. A noise-aware rule without a usable ``B_noise`` (nan or
    negative) falls back to its small-batch limit, with a note; a change of LR gets a note comparing the two."""
    if old_batch_size == new_batch_size:
        return lr, ()
    if rule not in NOISE_RULES:
        return lr * lr_factor(old_batch_size, new_batch_size, rule), ()
    limit = SMALL_BATCH_LIMIT[rule]
    small = lr_factor(old_batch_size, new_batch_size, limit)
    if math.isnan(b_noise) or b_noise < 0:
        return lr * small, (f"no usable B_noise ({b_noise:.4g}): {rule} taken at its small-batch limit, {limit}",)
    factor = lr_factor(old_batch_size, new_batch_size, rule, b_noise)
    note = (
        f"LR ×{factor:.3g} = {rule} from batch {old_batch_size} to {new_batch_size} at B_noise = {b_noise:.4g}; "
        f"{limit} scaling, its small-batch limit (B ≪ B_noise), would give ×{small:.3g}"
    )
    return lr * factor, (note,)


def sgd_ceiling(
    current_lr: float, rule: str, sharpness: Optional[float], optimizer: OptimizerLike, *, automatic: bool
) -> tuple[Ceiling, tuple[str, ...]]:
    """The largest LR allowed for an SGD rule: ``max(current, 2(1+β)/λ_max)`` given ``sharpness``; without it,
    the current LR for the family's default rule (``automatic``), none for an explicit ``lr_rule``. Adaptive
    rules: none (``sharpness`` not used, with a note)."""
    if rule not in SGD_RULES:
        if sharpness is None:
            return Ceiling(), ()
        return Ceiling(), (
            f"sharpness λ_max = {sharpness:.4g} not used: the stability limit 2/λ_max holds for SGD; an adaptive "
            "optimizer's limit is on the preconditioned Hessian",
        )
    if sharpness is None:
        return Ceiling(current_lr if automatic else None), ()
    momentum = momentum_of(optimizer)
    limit = stability_limit(sharpness, momentum or Momentum())
    unknown = () if momentum is not None else (
        "momentum unknown (pass the optimizer instance): the limit 2/λ_max of plain SGD is assumed",
    )
    return Ceiling(max(current_lr, limit), limit, sharpness), unknown


def _held_note(rule: str, wanted: float, lr: float, ceiling: Ceiling) -> tuple[str, ...]:
    if ceiling.stability_limit is not None:
        return (
            f"LR increase capped at the curvature stability limit {ceiling.stability_limit:.4g} (λ_max = "
            f"{ceiling.sharpness:.4g}; the {rule} rule gave {wanted:.4g}); never below the current LR",
        )
    return (
        f"SGD learning rate not raised (the {rule} rule gave {wanted:.4g}): the curvature stability limit is "
        "unknown and a tuned SGD LR usually sits at it (on digits the rule alone diverged in 12 of 15 batch "
        "increases from tuned LRs; benchmarks/RESULTS.md). Pass sharpness= (the largest λ_max seen early in training, from "
        f"gns_callback.curvature.sharpness) to raise it up to 2(1+β)/λ_max, or lr_rule={rule!r} to apply the "
        "rule as is",
    )


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
