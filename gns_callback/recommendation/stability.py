"""The curvature (stability) limit on an SGD learning rate, given the sharpness ``λ_max`` of the loss.

On a quadratic with curvature ``λ``, SGD's update ``v ← βv + (1−d)g``, ``θ ← θ − lr·v`` (PyTorch's heavy-ball
form with momentum ``β`` and dampening ``d``) iterates ``x_{t+1} = (1 + β − lr(1−d)λ)x_t − βx_{t−1}``, which
is stable if and only if

    lr < 2(1 + β) / ((1 − d)·λ)                     (heavy ball; 2/λ without momentum)
    lr < (2 + 2β) / ((1 + 2β)(1 − d)·λ)             (Nesterov)

(Goh 2017, "Why Momentum Really Works", Distill; Cohen et al. 2021, "Gradient Descent on Neural Networks
Typically Occurs at the Edge of Stability", arXiv:2103.00065, sec. 3 and appendix for momentum). Along the
largest-curvature direction the same holds for a network near a point with Hessian top eigenvalue ``λ_max``.

This bounds an LR *increase* only: the user's current LR is known to train, so it is never lowered below
what they use. Adaptive optimizers (Adam, ...) are stable up to a limit on the *preconditioned* Hessian
(Cohen et al. 2022, "Adaptive Gradient Methods at the Edge of Stability", arXiv:2207.14484), which ``λ_max``
of the plain Hessian does not give, so no cap applies to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from gns_callback.recommendation.rules import first_param_group


@dataclass(frozen=True)
class Momentum:
    """SGD's momentum ``beta``, ``dampening`` and ``nesterov`` flag (PyTorch's ``torch.optim.SGD`` meaning)."""

    beta: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False


def stability_limit(sharpness: float, momentum: Momentum = Momentum()) -> float:
    """The largest stable SGD learning rate for top Hessian eigenvalue ``sharpness`` (see the module docstring).

    ``inf`` when ``sharpness ≤ 0`` (no positive curvature: no limit).

    >>> stability_limit(4.0), stability_limit(4.0, Momentum(0.9))
    (0.5, 0.95)
    >>> round(stability_limit(4.0, Momentum(0.9, nesterov=True)), 4)
    0.3393
    """
    if math.isnan(sharpness):
        raise ValueError("sharpness must be a number (the top Hessian eigenvalue λ_max), got nan")
    if sharpness <= 0:
        return math.inf
    beta, damp = momentum.beta, momentum.dampening
    if not (0.0 <= beta < 1.0 and 0.0 <= damp < 1.0):
        raise ValueError(f"momentum must be in [0, 1) and dampening in [0, 1), got {beta!r}, {damp!r}")
    numerator = 2.0 * (1.0 + beta)
    if momentum.nesterov:
        numerator /= 1.0 + 2.0 * beta
    return numerator / ((1.0 - damp) * sharpness)


def momentum_of(optimizer: Any) -> Optional[Momentum]:
    """The momentum settings of an optimizer *instance* (its first parameter group), ``None`` for a class, a name
    or anything without ``param_groups`` (then unknown: callers assume none, the tighter limit)."""
    group = first_param_group(optimizer)
    if group is None:
        return None
    return Momentum(
        float(group.get("momentum", 0.0) or 0.0),
        float(group.get("dampening", 0.0) or 0.0),
        bool(group.get("nesterov", False)),
    )


def cap_increase(new_lr: float, current_lr: float, limit: float) -> float:
    """``new_lr`` unless it is an increase past ``limit``; then ``limit``, but never below ``current_lr``.

    >>> cap_increase(2.0, 0.5, 1.0), cap_increase(2.0, 1.5, 1.0), cap_increase(0.2, 0.5, 0.1)
    (1.0, 1.5, 0.2)
    """
    if new_lr <= current_lr or new_lr <= limit:
        return new_lr
    return max(current_lr, limit)
