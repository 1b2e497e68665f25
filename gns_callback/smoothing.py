"""Smoothing of per-step (numerator, denominator) estimates, and the ratio read off them.

The noise scale is a ratio of means, ``B_simple = E[tr Σ̂]/E[|Ĝ|²]``, not a mean of ratios: single-step
estimates are unbiased but noisy and often negative, and their ratio is neither. So we keep
exponentially weighted sums of the numerator ``x``, the denominator ``y``, their squares and cross
product, and only form the ratio (and its Fieller interval) when it is read.

Weights are ``w_t = decay^(T−t)``. The weighted mean ``Σw·x/Σw`` is exactly the bias-corrected EMA
``m_T/(1 − decay^T)`` of Adam-style smoothing; ``decay = 1`` gives the plain run average. The variance of
a weighted mean of independent draws is ``σ²·Σw²/(Σw)² = σ²/n_eff`` with ``n_eff = (Σw)²/Σw²``.

The fourth-order sums give the kurtosis of ``x − R̂·y``, the quantity Fieller's interval studentizes; heavy tails
lower its degrees of freedom (:func:`gns_callback.confidence.kurtosis_dof`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from gns_callback.confidence import fieller_interval, kurtosis_dof, t_quantile

#: Order of the entries of :attr:`RatioAccumulator.sums`: the weights, the first and second moments, and the fourth
#: moments (``xxxy`` is ``Σw·x³·y``).
SUM_FIELDS = ("w", "w2", "x", "y", "xx", "yy", "xy", "xxxx", "xxxy", "xxyy", "xyyy", "yyyy")
#: The sums kept before the fourth moments were (a state saved then resumes with them unknown).
SECOND_ORDER_FIELDS = 7
#: Below this share of its terms' size, ``Σw·(x − R·y)⁴`` is lost to rounding and the kurtosis counts as unknown.
_CANCELLATION = 1e-9


@dataclass(frozen=True)
class RatioSummary:
    """Weighted means of ``x`` and ``y``, their ratio, and its confidence interval."""

    mean_x: float
    mean_y: float
    ratio: float
    ci_low: float
    ci_high: float
    effective_steps: float


def summarize_ratio(sums: Sequence[float], confidence: float = 0.95) -> RatioSummary:
    """Ratio ``mean_x/mean_y`` of weighted means and its Fieller interval from the sums in ``SUM_FIELDS`` order.

    The ratio is clamped to ``[0, ∞)`` only here, at read time; ``inf`` when ``mean_y <= 0``
    (the true gradient is not resolved yet). The (co)variances use reliability-weight corrections and the
    Student-t quantile with ``n_eff − 1`` degrees of freedom, fewer where ``x − R̂·y`` is heavy-tailed
    (:func:`excess_kurtosis`; sums without the fourth moments read as normal).
    """
    w, w2, sx, sy, sxx, syy, sxy = (float(v) for v in sums[:SECOND_ORDER_FIELDS])
    if w <= 0.0:
        return RatioSummary(math.nan, math.nan, math.nan, 0.0, math.inf, 0.0)
    mx, my = sx / w, sy / w
    ratio = max(mx / my, 0.0) if my > 0.0 else math.inf
    n_eff = w * w / w2
    if n_eff <= 1.0 + 1e-9:
        return RatioSummary(mx, my, ratio, 0.0, math.inf, n_eff)
    # Unbiased weighted (co)variance of one draw, then divided by n_eff for the variance of the mean.
    norm = w - w2 / w
    var_x = max(sxx - w * mx * mx, 0.0) / norm
    var_y = max(syy - w * my * my, 0.0) / norm
    cov_xy = (sxy - w * mx * my) / norm
    kurtosis = excess_kurtosis(sums, mx / my) if my != 0.0 else math.nan
    t = t_quantile(confidence, kurtosis_dof(n_eff, kurtosis))
    low, high = fieller_interval(mx, my, var_x / n_eff, var_y / n_eff, cov_xy / n_eff, t)
    return RatioSummary(mx, my, ratio, low, high, n_eff)


def excess_kurtosis(sums: Sequence[float], r: float) -> float:
    """Weighted excess kurtosis ``m4/m2² − 3`` of ``z = x − r·y`` from the sums in ``SUM_FIELDS`` order.

    At ``r = R̂ = mean_x/mean_y`` the weighted mean of ``z`` is zero, so its central moments are its raw ones:
    ``m2 = Σw·z²/Σw``, ``m4 = Σw·z⁴/Σw`` with ``z⁴`` expanded binomially. ``nan`` where unknown: sums without
    the fourth moments, a non-finite sum, or ``m4`` lost to rounding against its terms.
    """
    if len(sums) < len(SUM_FIELDS) or not math.isfinite(r):
        return math.nan
    w, _, _, _, sxx, syy, sxy, *fourth = (float(v) for v in sums)
    powers = [1.0, r, r * r, r * r * r, r * r * r * r]  # products, not r**k: they overflow to inf, never raise
    terms = [c * p * s for c, p, s in zip((1.0, -4.0, 6.0, -4.0, 1.0), powers, fourth)]
    m4, m2 = sum(terms) / w, (sxx - 2.0 * r * sxy + r * r * syy) / w
    size, square = sum(abs(term) for term in terms) / w, m2 * m2
    if not (math.isfinite(size) and square > 0.0 and m4 > _CANCELLATION * size):
        return math.nan
    return m4 / square - 3.0


def moment_columns(x: Any, y: Any, one: Any) -> list[Any]:
    """One step's (or, elementwise, many steps') contributions in ``SUM_FIELDS`` order: ``[1, 1, x, y, x², y², xy,
    x⁴, x³y, x²y², xy³, y⁴]`` (``one``: ones shaped like ``x``; tensors or NumPy arrays)."""
    xx, yy, xy = x * x, y * y, x * y
    return [one, one, x, y, xx, yy, xy, xx * xx, xx * xy, xx * yy, xy * yy, yy * yy]


def step_vector(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One step's contribution in ``SUM_FIELDS`` order (float64): :func:`moment_columns`."""
    x, y = x.to(torch.float64), y.to(torch.float64)
    return torch.stack(moment_columns(x, y, torch.ones_like(x)))


def step_values(x: float, y: float) -> np.ndarray:
    """:func:`step_vector` of host floats, as a NumPy float64 array (the same numbers)."""
    x, y = np.float64(x), np.float64(y)
    return np.array(moment_columns(x, y, np.float64(1.0)), dtype=np.float64)


def decay_factors(decay: float) -> list[float]:
    """What one step multiplies each of the sums by: ``d`` for every weighted sum, ``d²`` for ``Σw²``."""
    return [decay * decay if field == "w2" else decay for field in SUM_FIELDS]


def full_sums(sums: Sequence[float]) -> list[float]:
    """``sums`` in ``SUM_FIELDS`` order; a state saved before the fourth moments gets them as unknown (``nan``)."""
    sums = [float(v) for v in sums]
    return sums + [math.nan] * (len(SUM_FIELDS) - len(sums))


class RatioAccumulator:
    """Exponentially weighted sums of per-step ``(x, y)`` pairs, kept on the device (no host sync on update).

    ``decay`` in ``[0, 1]``; ``1.0`` gives equal weights (the run average).
    """

    def __init__(self, decay: float) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay}")
        self.decay = float(decay)
        self.sums = torch.zeros(len(SUM_FIELDS), dtype=torch.float64)
        self._decays = torch.tensor(decay_factors(self.decay), dtype=torch.float64)

    def update(self, x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor) -> None:
        """Add one step's ``(x, y)``; a step with ``valid == False`` changes nothing (no decay either)."""
        self.update_vector(step_vector(x, y), valid)

    def update_vector(self, step: torch.Tensor, valid: torch.Tensor) -> None:
        """:meth:`update` with the step's :func:`step_vector` already built (shared by several accumulators)."""
        if self.sums.device != step.device:
            self.sums = self.sums.to(step.device)
            self._decays = self._decays.to(step.device)
        # where() picks, so a non-finite step vector never leaks into the sums.
        self.sums = torch.where(valid, self.sums * self._decays + step, self.sums)

    def update_values(self, step: np.ndarray, valid: bool) -> None:
        """:meth:`update_vector` from a host :func:`step_values` (the sums move to the CPU): no tensor op."""
        if self.sums.device.type != "cpu":
            self.sums, self._decays = self.sums.cpu(), self._decays.cpu()
        if valid:
            self.sums = torch.from_numpy(self.sums.numpy() * self._decays.numpy() + step)

    def summary(self, confidence: float = 0.95) -> RatioSummary:
        """Read the ratio and its interval (one device-to-host copy)."""
        return summarize_ratio(self.sums.tolist(), confidence)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "sums": self.sums.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.decay = float(state["decay"])
        device = self.sums.device
        self.sums = torch.tensor(full_sums(state["sums"]), dtype=torch.float64, device=device)
        self._decays = torch.tensor(decay_factors(self.decay), dtype=torch.float64, device=device)
