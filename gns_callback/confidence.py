"""Confidence intervals for a ratio of two means: Fieller's theorem (Fieller 1954).

The noise scale is a ratio ``B_simple = E[x]/E[y]`` of the means of two correlated per-step
estimates (``x`` = tr(Σ), ``y`` = |G|²). With ``mx, my`` the sample means and ``vxx, vyy, vxy``
the (co)variances *of those means*, Fieller's set is every ``R`` with

    (mx − R·my)² ≤ t²·(vxx − 2R·vxy + R²·vyy),

a quadratic inequality in ``R``. When ``my`` is significantly non-zero (``my² > t²·vyy``) it is a bounded
interval; otherwise the data cannot rule out ``|G|² ≈ 0`` and the interval is unbounded above.
Unlike the delta method it stays honest when the denominator is noisy, which is the common case
for ``|G|²`` late in training. Assumption: the per-step pairs ``(x, y)`` are independent draws
(true at fixed parameters with i.i.d. batches; approximately true while parameters move slowly).
"""

from __future__ import annotations

import math

from scipy import stats


def t_quantile(confidence: float, dof: float) -> float:
    """Two-sided Student-t quantile ``t_{(1+c)/2}(dof)``; ``inf`` when ``dof <= 0``."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not dof > 0:
        return math.inf
    return float(stats.t.ppf(0.5 + confidence / 2.0, dof))


def fieller_interval(
    mx: float, my: float, vxx: float, vyy: float, vxy: float, t: float
) -> tuple[float, float]:
    """Fieller interval for ``mx/my``, restricted to ``[0, ∞)`` (a noise scale is non-negative).

    Returns ``(low, high)``; ``high`` is ``inf`` when the denominator is not significantly positive.
    """
    if not math.isfinite(t):
        return 0.0, math.inf
    t2 = t * t
    a = my * my - t2 * vyy
    b = -2.0 * (mx * my - t2 * vxy)
    c = mx * mx - t2 * vxx
    disc = b * b - 4.0 * a * c
    if a > 0.0 and my > 0.0:
        root = math.sqrt(max(disc, 0.0))
        low, high = (-b - root) / (2.0 * a), (-b + root) / (2.0 * a)
        return max(low, 0.0), max(high, 0.0)
    if a > 0.0 or disc < 0.0 or a == 0.0:
        # a > 0 with my <= 0: |G|² significantly non-positive, which no noise scale explains.
        return 0.0, math.inf
    # Denominator compatible with zero: the set is (-∞, r1] ∪ [r2, ∞); keep its non-negative part.
    root = math.sqrt(disc)
    r1, r2 = sorted(((-b - root) / (2.0 * a), (-b + root) / (2.0 * a)))
    return (0.0 if r1 >= 0.0 else max(r2, 0.0)), math.inf
