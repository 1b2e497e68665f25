"""Hysteresis for opt-in batch-size adaptation during training (pure; the callback applies the decision).

Only ``accumulate_grad_batches`` changes (micro-batch and devices stay, so memory is safe; Lightning supports a
change at an epoch boundary, as ``GradientAccumulationScheduler`` does). A change happens only when

1. the recommendation can be acted on: its interval passed :func:`~gns_callback.recommendation.assess`, or lies
   wholly on one side of the current batch (``toward_interval``: the move to its near end, which every value of the
   interval agrees with; before, adapt waited for a narrow interval, which a run at a batch far below the knee
   rarely measured: from batch 8 it changed nothing on five of six scikit-learn problems, benchmarks/RESULTS.md),
2. the recommended global batch differs from the current one by at least ``factor`` (≥ 1.5× or ≤ 1/1.5×),
3. and that held, in the same direction, for ``patience`` consecutive checks.

Anything else (in the band, untrusted, or the direction flipped) resets the streak, so alternating inputs never
change anything. After a change, ``cooldown`` checks are ignored while the estimate settles at the new batch. The
new accumulation is the median of the streak's targets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from gns_callback.recommendation.rules import scale_lr, warmup_lr


@dataclass(frozen=True)
class AdaptDecision:
    """What :meth:`AdaptPolicy.decide` says: ``change`` and, if so, the new ``accumulate_grad_batches``.

    ``b_noise``: the noise scale of the recommendation decided on (``inf`` when a plain batch size was given),
    for the noise-aware LR rules; ``lr_ceiling_factor``: the largest LR factor it allows (its ``lr_ceiling``
    over its current LR; ``inf``: unbounded).
    """

    change: bool
    accumulate_grad_batches: int
    batch_size: int
    batch_ratio: float  # new global batch / current global batch (1.0 without a change)
    reason: str
    b_noise: float = math.inf
    lr_ceiling_factor: float = math.inf

    def new_lr(self, old_lr: float, rule: str) -> float:
        """The LR for the new batch by ``rule`` (see :mod:`.rules`), the noise-aware ones at :attr:`b_noise`; an
        increase stops at ``old_lr·lr_ceiling_factor``."""
        new = scale_lr(old_lr, self.batch_size / self.batch_ratio, self.batch_size, rule, self.b_noise)
        return new if new <= old_lr else min(new, old_lr * self.lr_ceiling_factor)

    def lr_schedule(self, old_lr: float, rule: str, warmup_steps: int) -> Callable[[int], float]:
        """``lr(step)``, ``step`` counted from the change: linear ramp from ``old_lr`` to :meth:`new_lr`.

        A decrease is applied at once (no ramp needed).
        """
        target = self.new_lr(old_lr, rule)
        steps = warmup_steps if target > old_lr else 0
        return lambda step: warmup_lr(step, start_lr=old_lr, target_lr=target, warmup_steps=steps)


@dataclass
class AdaptPolicy:
    """Decide when to change ``accumulate_grad_batches`` (see the module docstring).

    Args:
        factor: the band: no change while ``1/factor < recommended/current < factor``.
        patience: consecutive out-of-band checks, same direction, before a change.
        cooldown: checks ignored after a change.
        min_accumulate, max_accumulate: bounds on the new accumulation.
    """

    factor: float = 1.5
    patience: int = 3
    cooldown: int = 0
    min_accumulate: int = 1
    max_accumulate: Optional[int] = None
    _direction: int = field(default=0, repr=False)
    _pending: list = field(default_factory=list, repr=False)
    _cooldown_left: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.factor <= 1.0:
            raise ValueError("factor must be > 1")
        if self.patience < 1:
            raise ValueError("patience must be ≥ 1")

    def reset(self) -> None:
        self._direction, self._pending = 0, []

    def decide(
        self, current_accumulate: int, recommendation: Any, *, micro_batch_size: int, num_devices: int = 1
    ) -> AdaptDecision:
        """One check. ``recommendation`` is a :class:`Recommendation` (its ``batch_size`` and ``actionable``) or a
        plain recommended global batch size (taken as actionable)."""
        per_accum = micro_batch_size * num_devices
        current = current_accumulate * per_accum

        def keep(reason: str) -> AdaptDecision:
            return AdaptDecision(False, current_accumulate, current, 1.0, reason)

        b_noise, ceiling = _noise_and_ceiling(recommendation)

        if self._cooldown_left > 0:
            self._cooldown_left -= 1
            self.reset()
            return keep(f"cooling down after a change ({self._cooldown_left} checks left)")
        if isinstance(recommendation, (int, float)):
            target, actionable = float(recommendation), True
        else:
            target, actionable = float(recommendation.batch_size), bool(recommendation.actionable)
        if not actionable:
            self.reset()
            return keep("estimate not resolved enough to act on")
        if not (math.isfinite(target) and target > 0):
            self.reset()
            return keep("no finite recommendation")
        ratio = target / current
        accum = max(self.min_accumulate, round(target / per_accum))
        if self.max_accumulate is not None:
            accum = min(accum, self.max_accumulate)
        if 1.0 / self.factor < ratio < self.factor or accum == current_accumulate:
            self.reset()
            return keep(f"recommended/current = {ratio:.3g} inside the band (1/{self.factor:g}, {self.factor:g})")
        direction = 1 if ratio > 1 else -1
        if direction != self._direction:
            self._direction, self._pending = direction, []
        self._pending.append(accum)
        if len(self._pending) < self.patience:
            return keep(f"{'increase' if direction > 0 else 'decrease'} pending ({len(self._pending)}/{self.patience})")
        new = sorted(self._pending)[(len(self._pending) - 1) // 2]
        self.reset()
        self._cooldown_left = self.cooldown
        return AdaptDecision(
            True,
            new,
            new * per_accum,
            new / current_accumulate,
            f"recommended batch persisted {self.patience} checks beyond ×{self.factor:g}: accumulate "
            f"{current_accumulate} → {new}",
            b_noise,
            ceiling,
        )

    # Checkpointable state: plain Python types only.
    def state_dict(self) -> dict[str, Any]:
        return {"direction": self._direction, "pending": list(self._pending), "cooldown_left": self._cooldown_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._direction = int(state.get("direction", 0))
        self._pending = [int(x) for x in state.get("pending", [])]
        self._cooldown_left = int(state.get("cooldown_left", 0))


def _noise_and_ceiling(recommendation: Any) -> tuple[float, float]:
    """``(B_noise, LR ceiling factor)`` of a :class:`Recommendation`; ``(inf, inf)`` for a plain batch size."""
    if isinstance(recommendation, (int, float)):
        return math.inf, math.inf
    ceiling = getattr(recommendation, "lr_ceiling", None)
    current = recommendation.current.learning_rate
    factor = ceiling / current if (ceiling is not None and current) else math.inf
    return float(recommendation.b_noise), factor
