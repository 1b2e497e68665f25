"""The whole model's ``B_simple`` when some trainable parameters are left out of the measured norms.

Per-example norms measure the covered parameters ``c`` (layers of supported types): ``B_c = tr Σ_c / |G_c|²``. The
parameters left out ``u`` (a learned temperature, a ``PReLU`` slope, a layer-scale vector, a layer of an unsupported
type) still have their part of every step's gradient, whose squared norm over them has the expectation

    U = E|g_{B,u}|² = |G_u|² + φ·tr Σ_u / B

for ``B`` examples per step (``φ = (N − B)/(N − 1)`` for batches drawn without replacement from ``N`` examples,
:mod:`gns_callback.sampling`; else 1). However ``U`` splits into signal and noise, the whole model's

    B_simple = (tr Σ_c + tr Σ_u) / (|G_c|² + |G_u|²)  lies in  [B_c / (1 + u), B_c + (B/φ)·u],  u = U / |G_c|²:

it falls monotonically as ``|G_u|²`` goes from 0 (``U`` all noise: the upper end) to ``U`` (all signal: the lower
end). The step reads ``U`` against the covered part of the same gradient, ``r = U / E|g_{B,c}|²`` with
``E|g_{B,c}|² = |G_c|² + φ·tr Σ_c / B``, so ``u = r·(1 + φ·B_c / B)``. Both ends rise with ``B_c``: an interval
``[L, H]`` for ``B_c`` becomes ``[lower(L), upper(H)]`` for the whole model, at the same level (``r`` is read over
the same steps; its own sampling error is not added).

A single scalar can matter: a logit scale of 0.05 on the digits MLP (one parameter of 2,411) makes the whole model's
``B_simple`` 171 against the covered parameters' 82 (``tests/test_left_out.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from gns_callback.estimate import GNSEstimate

__all__ = ["LeftOutShare", "whole_model_interval"]


def whole_model_interval(low: float, high: float, share: float, batch: float, phi: float = 1.0) -> tuple[float, float]:
    """``[lower(low), upper(high)]``: an interval for the covered parameters' ``B_simple`` widened to hold the whole
    model's (module docstring). ``share``: ``r``, the left-out parameters' part of the step gradient's squared norm
    against the covered part's; ``batch``: examples per optimizer step; ``phi``: the finite-population factor."""
    if share <= 0.0:
        return low, high
    lower = low / (1.0 + share * (1.0 + phi * low / batch)) if math.isfinite(low) else low
    upper = high + share * (batch / phi + high) if phi > 0.0 else math.inf
    return lower, upper


@dataclass
class _Sums:
    """Weighted sums of the left-out and measured squared norms of the step gradient and of the step's examples."""

    left: float = 0.0
    measured: float = 0.0
    examples: float = 0.0
    weight: float = 0.0

    def add(self, left: float, measured: float, examples: float, decay: float) -> None:
        self.left = decay * self.left + left
        self.measured = decay * self.measured + measured
        self.examples = decay * self.examples + examples
        self.weight = decay * self.weight + 1.0

    def share(self) -> float:
        return self.left / self.measured if self.measured > 0.0 else (math.inf if self.left > 0.0 else 0.0)

    def batch(self) -> float:
        return self.examples / self.weight if self.weight > 0.0 else math.nan


class LeftOutShare:
    """``r`` (module docstring) over the run, and over a recent window of decay ``ema_decay`` (as the recent
    estimate's base window), from each measured step's ``|g_B|²`` over the left-out and over the measured
    parameters (any common scale: only their ratio is used) and its number of examples."""

    def __init__(self, ema_decay: float) -> None:
        self.ema_decay = float(ema_decay)
        self.run, self.recent = _Sums(), _Sums()

    def update(self, left_sq: float, measured_sq: float, examples: float, valid: bool) -> None:
        """One measured step; a step not valid for the estimates (or with a non-finite norm) adds nothing."""
        if not (valid and math.isfinite(left_sq) and math.isfinite(measured_sq)):
            return
        self.run.add(left_sq, measured_sq, examples, 1.0)
        self.recent.add(left_sq, measured_sq, examples, self.ema_decay)

    def share(self, recent: bool = False) -> float:
        """``r`` over the run (or the recent window): 0 when nothing is left out."""
        return (self.recent if recent else self.run).share()

    def widened(self, estimate: GNSEstimate, population: Optional[int] = None) -> GNSEstimate:
        """``estimate`` (of the measured parameters) with its interval widened to hold the whole model's value."""
        if not estimate.measured:
            return estimate
        low, high = self.interval(estimate.ci_low, estimate.ci_high, population, recent=estimate.averaging == "ema")
        return replace(estimate, ci_low=low, ci_high=high)

    def interval(self, low: float, high: float, population: Optional[int] = None,
                 recent: bool = False) -> tuple[float, float]:
        """:func:`whole_model_interval` of ``[low, high]`` with ``r`` and the examples per step over the run (or the
        recent window), and the finite-population factor of ``population`` (None: batches drawn with replacement).
        Unchanged when nothing is left out."""
        sums = self.recent if recent else self.run
        share = sums.share()
        if share == 0.0:
            return low, high
        batch = sums.batch()
        phi = 1.0 if population is None else (population - batch) / max(population - 1, 1)
        return whole_model_interval(low, high, share, batch, phi)

    def state_dict(self) -> dict[str, Any]:
        return {"run": vars(self.run).copy(), "recent": vars(self.recent).copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run, self.recent = _Sums(**state["run"]), _Sums(**state["recent"])
