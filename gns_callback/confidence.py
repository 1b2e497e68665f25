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

Heavy tails: Student-t's ``n − 1`` degrees of freedom assume the per-step values are normal. Where a few examples
carry most of the gradient, the spread read from ``n`` steps is itself far noisier than that, and mostly too small;
:func:`kurtosis_dof` gives the degrees of freedom that the spread's measured kurtosis leaves.
"""

from __future__ import annotations

import math

from scipy.special import stdtrit


def t_quantile(confidence: float, dof: float) -> float:
    """Two-sided Student-t quantile ``t_{(1+c)/2}(dof)``; ``inf`` when ``dof <= 0``. ``scipy.special.stdtrit`` is
    ``scipy.stats.t.ppf``'s own kernel, at half the import time (0.4 s against 0.9 s)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if not dof > 0:
        return math.inf
    return float(stdtrit(dof, 0.5 + confidence / 2.0))


def kurtosis_dof(n: float, excess_kurtosis: float) -> float:
    """Degrees of freedom of a spread read from ``n`` draws of excess kurtosis ``κ``, by moment matching.

    ``Var(s²)/σ⁴ = 2/(n − 1) + κ/n`` (e.g. Kendall & Stuart, vol. 1, 10.17); a scaled ``χ²_ν/ν`` has ``2/ν``, so
    ``ν = 1/(1/(n − 1) + κ/(2n))`` (Satterthwaite 1946's matching). ``κ ≤ 0`` or unknown (``nan``) keeps
    ``n − 1``: tails lighter than normal are not used to narrow the interval.
    """
    if not (n > 1.0 and excess_kurtosis > 0.0):
        return n - 1.0
    return 1.0 / (1.0 / (n - 1.0) + excess_kurtosis / (2.0 * n))


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
