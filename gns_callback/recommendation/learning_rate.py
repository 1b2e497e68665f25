"""The learning rate for the recommended batch and the warmup to reach it (the policy around :mod:`.rules`).

The rule comes from ``lr_rule=`` when given (a user override), else from the optimizer's family
(:func:`~gns_callback.recommendation.rules.lr_rule_for`): noise-aware by default, McCandlish et al.'s
``ε(B) = ε_max/(1 + B_noise/B)`` (its square root for the Adam family; for adaptive optimizers without a first
moment, RMSprop and Adagrad at PyTorch's defaults, ``ε(B) ∝ √(1 + B_noise/B)``, which lowers the LR as the batch
rises: see :mod:`.rules`).

Which ``B_noise``. A constant LR has to survive the whole run, and an SGD LR is limited by the early phase, where
``|G|²`` is large and the noise scale small; so an SGD *increase* uses the *early* noise scale when the run
measured one (``early_b_noise``: :func:`gns_callback.critical_batch.early_window`) and it is the smaller, at the
lower end of its interval (``early_b_noise_low``) where given, as the batch moves to its interval's near end: on
breast cancer (a data set the rule was not calibrated on) the point value from a run at batch 8 read 34 where the
tuned LRs fit ``B_noise ≈ 15–30``; the increase it gave (batch 8 → 88, LR ×3.2 with its warmup, above the LR tuned
at 88) diverged on 5 of 200 fresh seeds, the lower end's (×2.3) on none, at 9% more steps; on the digits MLP the
lower end costs 7% more steps (``benchmarks/payoff.py --divergence-seeds``). A *decrease* uses the larger of the
two: a tuned LR sits at the stability edge, and on digits the early scale alone
kept the LR too high in 2 of 15 decreases from batch 128 (diverged or 3.7× the steps).
Measured on digits (``benchmarks/lr_transfer_digits.py``, MLP 64-64-10, LRs tuned at 8…512): the tuned SGD LRs
fit ``ε_max/(1 + B_noise/B)`` with ``B_noise ≈ 11``, the early window read 11–14 from runs at batch 8, 32 and 512,
while the run's critical batch is 32–35; with the critical batch as ``B_noise`` the rule diverged in 12 of 15
batch increases. The Adam family keeps the batch's ``B_noise`` (its tuned LRs kept growing up to batch 48–80
on the same MLP; ``benchmarks/payoff.py``).

An SGD-family LR *increase* is also bounded by the curvature: given the sharpness ``λ_max``, at the stability limit
``2(1+β)/λ_max`` (:mod:`.stability`) when the current LR is below it. When the current LR is already above it
(the largest λ_max of the batch Hessians overstates what binds: tuned digits runs trained at lr·λ_max up to 10),
the limit is reported and not applied. Without an early noise scale, the family's default keeps the current LR
on an increase: the rule alone at the batch's ``B_noise`` diverged (above). An explicit ``lr_rule=`` is applied
as asked (capped only when ``sharpness`` is given).

The family's default aims an SGD increase ×:data:`INCREASE_MARGIN` below the rule's value (never below the current
LR): on digits the rule's increases landed at the tuned LR, and the tuned LR itself diverged on some seeds.

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
#: An SGD-family LR increase aims this far below the rule's optimum (never below the current LR). A tuned SGD LR sits
#: within one 2^(1/4) grid step of divergence (digits: 1.41 diverged on some seeds where 1.19 never did), and the
#: cost is lopsided: a bit too low costs a few percent of the steps, too high diverges. 0.85 ≈ one such step.
INCREASE_MARGIN = 0.85
_MARGIN_NOTE = f"an SGD LR increase aims ×{INCREASE_MARGIN:g} below the rule's optimum (a tuned LR sits near divergence)"
_FAMILIES = {"noise_linear": "SGD family", "noise_sqrt": "adaptive (Adam) family",
             "noise_inverse_sqrt": "adaptive family without a first moment (RMSprop, Adagrad)", "none": "no rule"}
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
    early_b_noise: float = math.nan,
    early_b_noise_low: float = math.nan,
) -> LRChoice:
    """The current LR moved from ``current_batch_size`` to ``batch_size`` by the chosen rule at the noise scale
    :func:`noise_scale_for` picks, then bounded by :func:`sgd_ceiling` (SGD rules only)."""
    rule, source, notes = pick_rule(optimizer, lr_rule)
    citation = CITATIONS[rule] if source != USER_OVERRIDE else f"{USER_OVERRIDE} ({CITATIONS[rule]})"
    if current_lr is None:
        return LRChoice(rule, source, citation, None, notes)
    scale, which = noise_scale_for(rule, b_noise, early_b_noise, raising=batch_size > current_batch_size,
                                   early_low=early_b_noise_low)
    scaled, how = transfer(current_lr, current_batch_size, batch_size, rule, scale)
    if which in (EARLY, EARLY_LOW):
        how = tuple(f"{note} (B_noise of the {which}: it limits a constant SGD LR)" for note in how)
    automatic = source != USER_OVERRIDE
    ceiling, why = sgd_ceiling(current_lr, rule, sharpness, optimizer, automatic=automatic,
                               early=has_early_scale(rule, early_b_noise))
    aimed, margin = _with_margin(current_lr, scaled, rule, automatic=automatic)
    new_lr = aimed if ceiling.lr is None else cap_increase(aimed, current_lr, ceiling.lr)
    held = _held_note(rule, scaled, new_lr, ceiling) if new_lr < aimed else ()
    margin = margin if new_lr > current_lr and not held else ()
    return LRChoice(rule, source, citation, new_lr, notes + how + margin + why + held, ceiling)


EARLY = "early phase"
EARLY_LOW = "early phase, the lower end of its interval"
BATCH = "batch target"


def has_early_scale(rule: str, early_b_noise: float) -> bool:
    """A noise-aware SGD rule with a measured (finite, positive) early-phase noise scale."""
    return rule in SGD_RULES and rule in NOISE_RULES and 0.0 < early_b_noise < math.inf


def noise_scale_for(rule: str, b_noise: float, early_b_noise: float, *, raising: bool = True,
                    early_low: float = math.nan) -> tuple[float, str]:
    """``(B_noise, which)`` for the LR rule. A noise-aware SGD rule with a measured early noise scale (finite and
    positive) takes the more cautious of the two: the smaller when the batch rises (a smaller LR increase), the
    larger when it falls (a larger LR decrease). When the batch rises, the early scale is the lower end of its
    interval (``early_low``) where given. Otherwise the batch's ``B_noise`` (see the module doc)."""
    if not has_early_scale(rule, early_b_noise):
        return b_noise, BATCH
    early, which = early_b_noise, EARLY
    if raising and 0.0 <= early_low < early_b_noise:
        early, which = early_low, EARLY_LOW
    if math.isnan(b_noise) or b_noise < 0:
        return early, which
    cautious = min(early, b_noise) if raising else max(early, b_noise)
    return cautious, which if cautious == early else BATCH


def _with_margin(current_lr: float, scaled: float, rule: str, *, automatic: bool) -> tuple[float, tuple[str, ...]]:
    """An automatic SGD increase aimed ×:data:`INCREASE_MARGIN` below the rule's value, never below the current LR."""
    if not (automatic and rule in SGD_RULES and scaled > current_lr):
        return scaled, ()
    return max(current_lr, scaled * INCREASE_MARGIN), (_MARGIN_NOTE,)


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
    current_lr: float, rule: str, sharpness: Optional[float], optimizer: OptimizerLike, *, automatic: bool,
    early: bool = False,
) -> tuple[Ceiling, tuple[str, ...]]:
    """The largest LR allowed for an SGD rule: ``max(current, 2(1+β)/λ_max)`` given ``sharpness`` (none when the
    current LR is above that limit and the rule ran at the ``early`` noise scale); without a sharpness, the current
    LR for the family's default rule (``automatic``) unless ``early``, none for an explicit ``lr_rule``. Adaptive
    rules: none (``sharpness`` not used, with a note)."""
    if rule not in SGD_RULES:
        if sharpness is None:
            return Ceiling(), ()
        return Ceiling(), (
            f"sharpness λ_max = {sharpness:.4g} not used: the stability limit 2/λ_max holds for SGD; an adaptive "
            "optimizer's limit is on the preconditioned Hessian",
        )
    if sharpness is None:
        return Ceiling(current_lr if automatic and not early else None), ()
    momentum = momentum_of(optimizer)
    limit = stability_limit(sharpness, momentum or Momentum())
    unknown = () if momentum is not None else (
        "momentum unknown (pass the optimizer instance): the limit 2/λ_max of plain SGD is assumed",
    )
    if early and limit <= current_lr:
        return Ceiling(None, limit, sharpness), unknown + (
            f"stability limit 2(1+β)/λ_max = {limit:.4g} (λ_max = {sharpness:.4g}) not applied: the run already "
            f"trains at LR {current_lr:.4g}, above it",
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


def param_groups_note(lrs: list[float], factor: float) -> Optional[str]:
    """What to change where the optimizer's param groups run at different LRs: each group's, by the recommended LR's
    ``factor`` over the current one (the largest group's); None where the groups share one LR or the factor is
    unknown."""
    if len(set(lrs)) <= 1 or not math.isfinite(factor) or factor < 0.0:
        return None
    current = ", ".join(f"{lr:.4g}" for lr in lrs)
    scaled = ", ".join(f"{lr * factor:.4g}" for lr in lrs)
    return (f"the optimizer's {len(lrs)} param groups run at different LRs ({current}): the learning rates shown are "
            f"the largest group's; scale every group's LR by ×{factor:.3g} instead of setting one lr= "
            f"(lr={scaled})")


def peak_schedule_note(schedule: str, peaks: list[float], factor: float) -> Optional[str]:
    """What to change where a schedule sets the LR outright from peaks of its own (``OneCycleLR``, ``CyclicLR``):
    those peaks, by the recommended LR's ``factor`` over the current one (the schedule's start); None for a factor
    of 1 or an unknown one. Its warmup is the schedule's own."""
    if not math.isfinite(factor) or factor <= 0.0 or abs(factor - 1.0) < 1e-3:
        return None
    scaled = ", ".join(f"{peak * factor:.4g}" for peak in peaks)
    return (f"{schedule} sets the learning rate at every step, so the lr= line is where it starts: scale its max_lr "
            f"by ×{factor:.3g} instead (max_lr={scaled}), and leave the LinearLR warmup out: the schedule has its own")
