"""The steps/examples trade-off of McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training").

To reach a given loss, training at batch ``B`` takes ``S = S_min(1 + B_noise/B)`` optimizer steps and
``E = E_min(1 + B/B_noise)`` examples, so ``(S/S_min − 1)(E/E_min − 1) = 1``: a hyperbola on which ``B``
moves the operating point. At ``B = B_noise`` both factors are 2, the knee (the critical batch size
``B_crit = E_min/S_min``): below it a larger batch saves steps almost for free, above it each saved step
costs proportionally more examples. ``B_simple`` stands in for ``B_noise`` (equal when the Hessian is a
multiple of the identity).
"""

from __future__ import annotations

import math


def steps_factor(batch_size: float, b_noise: float) -> float:
    """``S/S_min = 1 + B_noise/B`` (``inf`` for an unbounded ``B_noise``, ``nan`` if unknown).

    >>> steps_factor(100, 100), steps_factor(300, 100)
    (2.0, 1.3333333333333333)
    """
    if math.isnan(b_noise) or batch_size <= 0:
        return math.nan
    if math.isinf(b_noise):
        return math.inf
    return 1.0 + max(b_noise, 0.0) / batch_size


def examples_factor(batch_size: float, b_noise: float) -> float:
    """``E/E_min = 1 + B/B_noise`` (``inf`` when ``B_noise = 0``, ``1`` when unbounded, ``nan`` if unknown).

    >>> examples_factor(100, 100), examples_factor(300, 100)
    (2.0, 4.0)
    """
    if math.isnan(b_noise) or batch_size <= 0:
        return math.nan
    if b_noise <= 0:
        return math.inf
    return 1.0 + batch_size / b_noise


def steps_for_examples_factor(examples: float) -> float:
    """The hyperbola: ``S/S_min = 1 + 1/(E/E_min − 1)`` (for plotting the curve)."""
    if examples <= 1.0:
        return math.inf
    return 1.0 + 1.0 / (examples - 1.0)


def throughput_at(table: dict[int, float], micro_batch_size: float) -> float | None:
    """Per-device samples/s at ``micro_batch_size`` from a measured ``{micro: samples/s}`` table.

    Linear interpolation between measured sizes; below the smallest, proportional to the size (a constant time
    per micro-batch: the pessimistic assumption for small batches); above the largest, flat (saturated).
    ``None`` for an empty table.

    >>> throughput_at({16: 800.0, 32: 1200.0}, 24), throughput_at({16: 800.0}, 8), throughput_at({16: 800.0}, 64)
    (1000.0, 400.0, 800.0)
    """
    points = sorted((int(k), float(v)) for k, v in table.items() if v is not None and math.isfinite(v) and v > 0)
    if not points or micro_batch_size is None or micro_batch_size <= 0:
        return None
    if micro_batch_size <= points[0][0]:
        return points[0][1] * micro_batch_size / points[0][0]
    if micro_batch_size >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= micro_batch_size <= x1:
            return y0 + (y1 - y0) * (micro_batch_size - x0) / (x1 - x0)
    return None  # unreachable
