"""Learning-rate scaling rules by optimizer family, and the warmup that goes with a large LR increase.

When the global batch grows by ``κ = B_new/B_old``:

* **linear** (``lr·κ``) for SGD and its momentum/Nesterov/LARS variants: Goyal et al. 2017, "Accurate, Large
  Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677).
* **sqrt** (``lr·√κ``) for adaptive methods (Adam, AdamW, RMSprop, Adagrad, LAMB, Adafactor, ...): Malladi,
  Lyu, Panigrahi, Arora 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms" (NeurIPS 2022,
  arXiv:2205.10287). Their full rule also sets ``1−β → κ(1−β)`` and ``ε → ε/√κ``; only the LR is changed here.
* **none**: keep the LR (L-BFGS, or a user override).

An optimizer that matches no family gets the square-root rule with a note: for a batch *increase* it raises
the LR less than the linear rule would, the safer error.

Warmup (Goyal et al.: a linear ramp from the old LR to the new one, 5 epochs for their 32× jump from batch 256
to 8192). The trigger and length follow the LR factor ``f = lr_new/lr_old`` — the jump that can diverge:

* ``f ≤ threshold`` (default 2): no warmup (the "2× — No" row of the usual guidance table);
* otherwise ``epochs = warmup_epochs · min(1, log f / log 32)``: 2 epochs at 4×, 3 at 8×, 4 at 16×, the full
  5 epochs from 32× on. A decrease of the LR never needs warmup.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch

LINEAR = "linear"
SQRT = "sqrt"
NONE = "none"
LR_RULES = (LINEAR, SQRT, NONE)

CITATIONS = {
    LINEAR: "Goyal et al. 2017, Accurate, Large Minibatch SGD (arXiv:1706.02677)",
    SQRT: "Malladi et al. 2022, On the SDEs and Scaling Rules for Adaptive Gradient Algorithms (arXiv:2205.10287)",
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
_LINEAR_TOKENS = ("sgd", "lars", "larc", "momentum", "nesterov")  # SGD, ASGD, SGDW, FusedSGD, LARS, ...

#: Goyal et al.'s warmup: 5 epochs for a 32× increase (batch 256 → 8192).
GOYAL_WARMUP_EPOCHS = 5.0
GOYAL_FACTOR = 32.0

OptimizerLike = Union[str, type, Any]


_MAX_WRAPPERS = 8


def _unwrap(optimizer: OptimizerLike) -> OptimizerLike:
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
    optimizer = _unwrap(optimizer)
    return (optimizer if isinstance(optimizer, type) else type(optimizer)).__name__


def _names(optimizer: OptimizerLike) -> list[str]:
    """Lower-case class names to match: the name itself, then (for classes/instances) the rest of the MRO."""
    if isinstance(optimizer, str) or optimizer is None:
        return [optimizer_name(optimizer).lower()]
    optimizer = _unwrap(optimizer)
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    return [c.__name__.lower() for c in cls.__mro__ if c.__name__ not in ("object", "Optimizer")]


def lr_rule_for(optimizer: OptimizerLike) -> tuple[str, Optional[str]]:
    """``(rule, note)`` for an optimizer class, instance or name; ``note`` is set when the family is unknown.

    >>> import torch
    >>> lr_rule_for(torch.optim.SGD)[0], lr_rule_for("AdamW")[0], lr_rule_for(torch.optim.RMSprop)[0]
    ('linear', 'sqrt', 'sqrt')
    """
    for name in _names(optimizer):
        if any(t in name for t in _NONE_TOKENS):
            return NONE, f"{optimizer_name(optimizer)}: no batch-size scaling rule; learning rate kept"
        if any(t in name for t in _SQRT_TOKENS):
            return SQRT, None
        if any(t in name for t in _LINEAR_TOKENS):
            return LINEAR, None
    if optimizer is None:
        return SQRT, "no optimizer given: square-root LR scaling assumed; pass optimizer= or lr_rule="
    return SQRT, (
        f"optimizer {optimizer_name(optimizer)!r} is not a known SGD- or Adam-family optimizer: square-root LR "
        "scaling assumed (the more cautious rule for an increase); pass lr_rule= to override"
    )


def lr_exponent(rule: str) -> float:
    if rule not in LR_RULES:
        raise ValueError(f"lr_rule must be one of {LR_RULES}, got {rule!r}")
    return {LINEAR: 1.0, SQRT: 0.5, NONE: 0.0}[rule]


def scale_lr(lr: float, old_batch_size: float, new_batch_size: float, rule: str) -> float:
    """``lr·(new/old)^p`` with ``p`` = 1 (linear), ½ (sqrt) or 0 (none).

    >>> scale_lr(0.1, 256, 1024, "linear"), scale_lr(1e-3, 64, 256, "sqrt")
    (0.4, 0.002)
    """
    if old_batch_size <= 0 or new_batch_size <= 0:
        raise ValueError("batch sizes must be positive")
    return lr * (new_batch_size / old_batch_size) ** lr_exponent(rule)


def warmup_epochs_for(
    lr_factor: float,
    *,
    threshold: float = 2.0,
    warmup_epochs: float = GOYAL_WARMUP_EPOCHS,
    full_factor: float = GOYAL_FACTOR,
) -> float:
    """Warmup length in epochs for an LR increase by ``lr_factor`` (0 up to ``threshold``; see module doc).

    >>> warmup_epochs_for(2.0), warmup_epochs_for(4.0), warmup_epochs_for(8.0), warmup_epochs_for(64.0)
    (0.0, 2.0, 3.0, 5.0)
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
