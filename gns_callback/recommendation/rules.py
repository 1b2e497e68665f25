"""Learning-rate scaling rules by optimizer family, and the warmup that goes with an LR increase.

When the global batch moves from ``B0`` to ``B1`` (``κ = B1/B0``), the LR is multiplied by:

* **noise_linear** (default for SGD and its momentum/Nesterov/LARS variants):
  ``(1 + B_noise/B0) / (1 + B_noise/B1)``. McCandlish, Kaplan, Amodei 2018, "An Empirical Model of Large-Batch
  Training" (arXiv:1812.06162), eq. 2.7: the optimal SGD step is ``ε_opt(B) = ε_max/(1 + B_noise/B)``, linear
  in ``B`` while ``B ≪ B_noise`` and flat above it. Its small-batch limit ``B0, B1 ≪ B_noise`` is the linear
  rule; well above ``B_noise`` the LR barely changes.
* **noise_sqrt** (default for adaptive methods with a first moment: Adam, AdamW, RMSprop with momentum, LAMB, ...):
  ``√((1 + B_noise/B0) / (1 + B_noise/B1))``, from ``ε(B) = ε_max/√(1 + B_noise/B)``: the same saturation
  applied to the square-root rule, which is its small-batch limit.
* **noise_inverse_sqrt** (default for adaptive methods whose update does not average the gradient over steps:
  RMSprop without momentum, Adagrad, Adam with ``β₁ = 0``): ``√((1 + B_noise/B1) / (1 + B_noise/B0))``, the
  inverse of noise_sqrt. Their step is ``lr·g/√v`` with ``v ≈ E[g²] = G² + σ²/B`` per coordinate, so its mean
  along the gradient, ``lr/√(1 + B_noise/B)``, *grows* with the batch; keeping it (the largest stable step) gives
  ``ε(B) ∝ √(1 + B_noise/B)``: a larger batch needs a smaller LR. Adam's first moment averages the noise out of
  the numerator instead, and its tuned LR rises with the batch. Measured on digits (MLP 64-64-10,
  ``benchmarks/payoff.py``): RMSprop tuned at batch 8 (LR 0.0134) and moved to 32, the square-root rule's LR
  0.0214 diverged on 8 of 8 fresh seeds, the kept LR on 5 of 8, this rule's 0.0084 on none (at 0.41× the steps
  of batch 8); Adagrad 8 → 24 (LR 0.16): kept, 7 of 8 diverged; this rule's 0.112, none. Followed from the
  callback's reading (digits, RMSprop 8 → 40 and 32 → 56, Adagrad 8 → 32 and 32 → 72): 1.08–1.13× the steps of the
  LR tuned at the new batch, none of 40 fresh runs diverged (noise_sqrt: 3 of 4 quick runs). Its cost: on breast
  cancer (RMSprop 8 → 112), where the reading (396) was 5× the slow-way B_crit, the LR fell to 0.30× and took 3.1×
  the steps of the LR tuned at 112 (still 0.35× the steps of batch 8); noise_sqrt diverged on 1 of 8 seeds there.
* **linear** (``lr·κ``): Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
  (arXiv:1706.02677). The small-batch limit of noise_linear; an explicit choice.
* **inverse_sqrt** (``lr/√κ``): the small-batch limit of noise_inverse_sqrt; an explicit choice.
* **sqrt** (``lr·√κ``): Malladi, Lyu, Panigrahi, Arora 2022, "On the SDEs and Scaling Rules for Adaptive
  Gradient Algorithms" (NeurIPS 2022, arXiv:2205.10287). Their full rule also sets ``1−β → κ(1−β)`` and
  ``ε → ε/√κ``; only the LR is changed here. The small-batch limit of noise_sqrt; an explicit choice.
* **none**: keep the LR (L-BFGS, or a user override).

Why the noise-aware forms are the defaults: linear scaling holds only while ``B ≪ B_noise``. Measured on
digits (``benchmarks/lr_transfer_digits.py``: MLP 64-64-10, SGD, LRs tuned at 8…512, ``B_crit ≈ 34``), lowering
the batch from a tuned LR by noise_linear (at the measured run-average ``B_simple``) took a median 1.06× the
steps of the LR tuned there, linear scaling 2.4× (512 → 16: 10×). Raising it, neither rule is safe for SGD: the
tuned LR stops growing at the curvature limit, so an SGD increase is bounded separately (see
:mod:`.learning_rate`). Adam (LRs tuned at 8…128): noise_sqrt and sqrt both within a median 1.3× of tuned,
neither diverged.

An optimizer that matches no family gets noise_sqrt with a note: for a batch *increase* it raises the LR less
than the linear forms would, the safer error.

Warmup (Goyal et al.: a linear ramp from the old LR to the new one, 5 epochs for their 32× jump from batch 256
to 8192). The length follows the LR factor ``f = lr_new/lr_old``:

* ``f ≤ threshold`` (default 1): no warmup — any LR increase gets one;
* otherwise ``epochs = warmup_epochs · min(1, log f / log 32)``: 1 epoch at 2×, 2 at 4×, 3 at 8×, 4 at 16×, the
  full 5 epochs from 32× on. A decrease of the LR never needs warmup.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch

NOISE_LINEAR = "noise_linear"
NOISE_SQRT = "noise_sqrt"
NOISE_INVERSE_SQRT = "noise_inverse_sqrt"
INVERSE_SQRT = "inverse_sqrt"
LINEAR = "linear"
SQRT = "sqrt"
NONE = "none"
LR_RULES = (NOISE_LINEAR, NOISE_SQRT, NOISE_INVERSE_SQRT, LINEAR, SQRT, INVERSE_SQRT, NONE)
#: Rules that need ``B_noise``.
NOISE_RULES = (NOISE_LINEAR, NOISE_SQRT, NOISE_INVERSE_SQRT)
#: The SGD-family rules (those a curvature stability limit applies to), and the adaptive-family ones.
SGD_RULES = (NOISE_LINEAR, LINEAR)
SQRT_RULES = (NOISE_SQRT, SQRT)
#: The rule each noise-aware rule tends to when ``B ≪ B_noise``.
SMALL_BATCH_LIMIT = {NOISE_LINEAR: LINEAR, NOISE_SQRT: SQRT, NOISE_INVERSE_SQRT: INVERSE_SQRT}

_GOYAL = "Goyal et al. 2017, Accurate, Large Minibatch SGD (arXiv:1706.02677)"
_MALLADI = "Malladi et al. 2022, On the SDEs and Scaling Rules for Adaptive Gradient Algorithms (arXiv:2205.10287)"
_MCCANDLISH = "McCandlish et al. 2018, An Empirical Model of Large-Batch Training (arXiv:1812.06162)"
CITATIONS = {
    NOISE_LINEAR: f"{_MCCANDLISH}: ε_opt(B) = ε_max/(1 + B_noise/B); linear scaling ({_GOYAL}) is its "
    "small-batch limit B ≪ B_noise",
    NOISE_SQRT: f"ε(B) = ε_max/√(1 + B_noise/B), the saturating form ({_MCCANDLISH}) of the square-root rule "
    f"({_MALLADI}), which is its small-batch limit B ≪ B_noise",
    LINEAR: f"{_GOYAL}; the small-batch limit B ≪ B_noise of the noise-aware rule",
    SQRT: f"{_MALLADI}; the small-batch limit B ≪ B_noise of the noise-aware rule",
    NOISE_INVERSE_SQRT: "ε(B) = ε₀·√(1 + B_noise/B): the mean step lr·|G|/√E[g²] of an adaptive optimizer without a "
    "first moment (its √v holds the batch's noise) kept as the batch moves; measured on digits, benchmarks/RESULTS.md",
    INVERSE_SQRT: "lr/√κ: the small-batch limit B ≪ B_noise of noise_inverse_sqrt",
    NONE: "learning rate kept",
}

# Lower-case substrings of a class name (or of any class in its MRO). Checked in this order.
_NONE_TOKENS = ("lbfgs",)
_SQRT_TOKENS = (
    "adam",  # Adam, AdamW, Adamax, NAdam, RAdam, SparseAdam, FusedAdam, AdamW8bit, DeepSpeedCPUAdam, ...
    "rmsprop",
    "adagrad",
    "adadelta",
    "adafactor",
    "lamb",  # You et al. 2019 also scale LAMB's LR by the square root
    "novograd",
    "adan",
    "shampoo",
    "sophia",
)
#: Adaptive optimizers whose update has no first moment at PyTorch's defaults (an instance's own settings decide).
_UNAVERAGED_TOKENS = ("rmsprop", "adagrad")
_LINEAR_TOKENS = ("sgd", "lars", "larc", "momentum", "nesterov")  # SGD, ASGD, SGDW, FusedSGD, LARS, ...

#: Goyal et al.'s warmup: 5 epochs for a 32× increase (batch 256 → 8192).
GOYAL_WARMUP_EPOCHS = 5.0
GOYAL_FACTOR = 32.0

OptimizerLike = Union[str, type, Any]


_MAX_WRAPPERS = 8


def unwrap_optimizer(optimizer: OptimizerLike) -> OptimizerLike:
    """The innermost torch optimizer of a wrapper that exposes it as ``.optimizer`` (training frameworks wrap
    optimizers this way, some in a dynamic subclass of the wrapped class); anything else is returned as is."""
    for _ in range(_MAX_WRAPPERS):
        if isinstance(optimizer, (str, type)):
            return optimizer
        try:
            inner = getattr(optimizer, "optimizer", None)
        except Exception:  # a property that raises: not a wrapper we can see through
            return optimizer
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return optimizer
        optimizer = inner
    return optimizer


def optimizer_name(optimizer: OptimizerLike) -> str:
    """The class name of an optimizer given as a name (``"torch.optim.AdamW"`` → ``"AdamW"``), class or instance."""
    if optimizer is None:
        return "unknown"
    if isinstance(optimizer, str):
        return optimizer.strip().rsplit(".", 1)[-1] or "unknown"
    optimizer = unwrap_optimizer(optimizer)
    return (optimizer if isinstance(optimizer, type) else type(optimizer)).__name__


def _names(optimizer: OptimizerLike) -> list[str]:
    """Lower-case class names to match: the name itself, then (for classes/instances) the rest of the MRO."""
    if isinstance(optimizer, str) or optimizer is None:
        return [optimizer_name(optimizer).lower()]
    optimizer = unwrap_optimizer(optimizer)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return [c.__name__.lower() for c in cls.__mro__ if c.__name__ not in ("object", "Optimizer")]


def first_param_group(optimizer: OptimizerLike) -> Optional[dict[str, Any]]:
    """The first parameter group of an optimizer *instance* (seen through wrappers, :func:`unwrap_optimizer`); ``None``
    for a class, a name, or anything without ``param_groups``."""
    optimizer = unwrap_optimizer(optimizer)
    groups = getattr(optimizer, "param_groups", None)
    return None if isinstance(optimizer, (str, type)) or not groups else groups[0]


def first_moment(optimizer: OptimizerLike) -> Optional[float]:
    """The weight an optimizer *instance*'s update gives past gradients, read off its first param group: Adam's
    ``β₁`` (``betas[0]``), else RMSprop's or SGD's ``momentum``; ``None`` for a class, a name, or a group with
    neither (Adagrad)."""
    group = first_param_group(optimizer)
    if group is None:
        return None
    if isinstance(group.get("betas"), (tuple, list)) and group["betas"]:
        return float(group["betas"][0])
    return float(group["momentum"]) if isinstance(group.get("momentum"), (int, float)) else None


def averages_gradients(optimizer: OptimizerLike, name: str) -> bool:
    """Whether an adaptive optimizer's update averages the gradient over steps (a first moment above 0): an
    instance's own setting where it has one (:func:`first_moment`), else by class ``name`` (RMSprop at PyTorch's
    default momentum 0 and Adagrad do not)."""
    beta = first_moment(optimizer)
    return beta > 0.0 if beta is not None else not any(t in name for t in _UNAVERAGED_TOKENS)


def lr_rule_for(optimizer: OptimizerLike) -> tuple[str, Optional[str]]:
    """``(rule, note)`` for an optimizer class, instance or name; ``note`` is set when the family is unknown.

    >>> import torch
    >>> lr_rule_for(torch.optim.SGD)[0], lr_rule_for("AdamW")[0], lr_rule_for(torch.optim.RMSprop)[0]
    ('noise_linear', 'noise_sqrt', 'noise_inverse_sqrt')
    """
    for name in _names(optimizer):
        if any(t in name for t in _NONE_TOKENS):
            return NONE, f"{optimizer_name(optimizer)}: no batch-size scaling rule; learning rate kept"
        if any(t in name for t in _SQRT_TOKENS):
            return (NOISE_SQRT if averages_gradients(optimizer, name) else NOISE_INVERSE_SQRT), None
        if any(t in name for t in _LINEAR_TOKENS):
            return NOISE_LINEAR, None
    if optimizer is None:
        return NOISE_SQRT, "no optimizer given: square-root LR scaling assumed; pass optimizer= or lr_rule="
    return NOISE_SQRT, (
        f"optimizer {optimizer_name(optimizer)!r} is not a known SGD- or Adam-family optimizer: square-root LR "
        "scaling assumed (the more cautious rule for an increase); pass lr_rule= to override"
    )


def check_rule(rule: str) -> str:
    """``rule`` if it is one of :data:`LR_RULES`, else a ``ValueError`` that lists them."""
    if rule not in LR_RULES:
        raise ValueError(f"lr_rule must be one of {LR_RULES}, got {rule!r}")
    return rule


def lr_exponent(rule: str) -> float:
    """``p`` in ``ε(B) ∝ (1 + B_noise/B)^(−p)``: 1 for the linear forms, ½ for the square-root ones, −½ for the
    inverse square-root ones, 0 for none."""
    check_rule(rule)
    return {NOISE_LINEAR: 1.0, LINEAR: 1.0, NOISE_SQRT: 0.5, SQRT: 0.5, NOISE_INVERSE_SQRT: -0.5, INVERSE_SQRT: -0.5,
            NONE: 0.0}[rule]


def lr_factor(old_batch_size: float, new_batch_size: float, rule: str, b_noise: Optional[float] = None) -> float:
    """The LR multiplier from ``B0 = old_batch_size`` to ``B1 = new_batch_size`` (see the module docstring).

    ``((1 + B_noise/B0)/(1 + B_noise/B1))^p`` for the noise-aware rules, written as
    ``(κ·(B0 + B_noise)/(B1 + B_noise))^p`` so that ``B_noise = inf`` gives the limit ``κ^p``; ``κ^p`` for the
    plain ones (``b_noise`` ignored); ``p`` from :func:`lr_exponent`.

    >>> round(lr_factor(8, 32, "noise_linear", 40.0), 6), lr_factor(8, 32, "linear")
    (2.666667, 4.0)
    >>> lr_factor(8, 32, "noise_linear", float("inf")), lr_factor(64, 256, "noise_sqrt", float("inf"))
    (4.0, 2.0)
    """
    if not (old_batch_size > 0 and new_batch_size > 0):
        raise ValueError(
            f"batch sizes must be positive, got old_batch_size={old_batch_size!r}, new_batch_size={new_batch_size!r}"
        )
    kappa = new_batch_size / old_batch_size
    p = lr_exponent(rule)
    if rule not in NOISE_RULES:
        return kappa**p
    if b_noise is None or math.isnan(b_noise) or b_noise < 0:
        raise ValueError(
            f"lr_rule={rule!r} needs b_noise, the noise scale (B_simple ≥ 0), got b_noise={b_noise!r}; pass the "
            f"estimate's B_simple, or use lr_rule={SMALL_BATCH_LIMIT[rule]!r} (its small-batch limit)"
        )
    if math.isinf(b_noise):
        return kappa**p
    return (kappa * (old_batch_size + b_noise) / (new_batch_size + b_noise)) ** p


def scale_lr(
    lr: float, old_batch_size: float, new_batch_size: float, rule: str, b_noise: Optional[float] = None
) -> float:
    """``lr · lr_factor(old_batch_size, new_batch_size, rule, b_noise)``.

    >>> scale_lr(0.1, 256, 1024, "linear"), scale_lr(1e-3, 64, 256, "sqrt")
    (0.4, 0.002)
    >>> round(scale_lr(1.5, 512, 16, "noise_linear", 16.0), 4)  # down to B = B_noise: about half, not 1/32
    0.7734
    """
    return lr * lr_factor(old_batch_size, new_batch_size, rule, b_noise)


def warmup_epochs_for(
    lr_factor: float,
    *,
    threshold: float = 1.0,
    warmup_epochs: float = GOYAL_WARMUP_EPOCHS,
    full_factor: float = GOYAL_FACTOR,
) -> float:
    """Warmup length in epochs for an LR increase by ``lr_factor`` (0 up to ``threshold``; see module doc).

    >>> warmup_epochs_for(1.0), warmup_epochs_for(2.0), warmup_epochs_for(8.0), warmup_epochs_for(64.0)
    (0.0, 1.0, 3.0, 5.0)
    """
    if not math.isfinite(lr_factor) or lr_factor <= threshold or lr_factor <= 1.0:
        return 0.0
    return warmup_epochs * min(1.0, math.log2(lr_factor) / math.log2(full_factor))


def warmup_lr(step: int, *, start_lr: float, target_lr: float, warmup_steps: Optional[int]) -> float:
    """Linear ramp from ``start_lr`` (the old LR) at step 0 to ``target_lr`` at ``warmup_steps``, then flat.

    This is Goyal et al.'s gradual warmup and what ``torch.optim.lr_scheduler.LinearLR(opt,
    start_factor=start_lr/target_lr, total_iters=warmup_steps)`` does when ``opt``'s LR is ``target_lr``.

    >>> [warmup_lr(s, start_lr=0.1, target_lr=0.5, warmup_steps=4) for s in (0, 2, 4, 9)]
    [0.1, 0.30000000000000004, 0.5, 0.5]
    """
    if not warmup_steps or warmup_steps <= 0 or step >= warmup_steps:
        return target_lr
    step = max(step, 0)
    return start_lr + (target_lr - start_lr) * step / warmup_steps


def warmup_lambda(start_factor: float, warmup_steps: Optional[int]) -> Callable[[int], float]:
    """A multiplier for ``torch.optim.lr_scheduler.LambdaLR``: ``start_factor`` → 1 linearly over the warmup."""

    def factor(step: int) -> float:
        return warmup_lr(step, start_lr=start_factor, target_lr=1.0, warmup_steps=warmup_steps)

    return factor
