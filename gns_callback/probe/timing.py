"""Repeated step timing, summarised so that noise is visible and no decision rests on it (pure Python).

Each repeat is one training step at a micro-batch size: forward+backward ``f_i`` and optimizer step ``o_i``
seconds, ``t_i = f_i + o_i``. A :class:`Timing` holds the median of ``t_i`` (robust to a stray slow step on a
shared machine), a distribution-free confidence interval for that median from order statistics, the
interquartile range relative to the median (the step-to-step scatter), and the medians of ``f_i`` and ``o_i``
(an accumulation-aware throughput needs them apart).

Interval for the median (e.g. Conover, *Practical Nonparametric Statistics*, §3.2): for ``m`` sorted values
``x_(1) ≤ … ≤ x_(m)``, ``[x_(k), x_(m+1−k)]`` covers their median with probability
``1 − 2·P(B ≤ k − 1)``, ``B ~ Binomial(m, ½)``; ``k`` is the largest with coverage ≥ the confidence. At 95%
that needs ``m ≥ 6``; with fewer repeats there is no interval, and :func:`faster` decides nothing.

The values are not the repeats themselves but the medians of ``BLOCKS`` consecutive blocks of them (the
batch-means idea of simulation output analysis). On a shared machine step times are not independent: load
from other processes comes in bursts lasting many steps, and an interval over single repeats is then far too
narrow (measured on a busy 2-core machine: ±3% within a run, while 5 runs' medians spread over 7–11%). Block
medians are nearly independent when a block outlasts a burst, so their interval widens with the bursts.
The median is the uncontended speed as long as fewer than half the steps are hit by another process's time
slice (they then take several ms longer); the spread shows how many are.

Two sizes are ranked only when their samples/s intervals do not overlap (:func:`faster`), a conservative
test (two 95% intervals that do not overlap differ at well beyond the 5% level).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence

CONFIDENCE = 0.95
#: The interval is taken over the medians of this many consecutive blocks of repeats (batch medians).
BLOCKS = 10


@dataclass(frozen=True)
class Timing:
    """Repeated timing of one micro-batch size (seconds per step; see the module docstring).

    Attributes:
        repeats: timed steps ``n``.
        seconds: median step time, forward+backward+optimizer.
        seconds_low, seconds_high: 95% interval for that median (``None`` when ``n < 6``).
        spread: interquartile range of the repeats over their median (``None`` when ``n < 2``).
        step_seconds, optimizer_seconds: medians of the forward+backward and optimizer parts.
    """

    repeats: int
    seconds: float
    seconds_low: Optional[float]
    seconds_high: Optional[float]
    spread: Optional[float]
    step_seconds: float
    optimizer_seconds: float

    @property
    def rel_halfwidth(self) -> Optional[float]:
        """Half the interval's width over the median: the relative precision of ``seconds``."""
        if self.seconds_low is None or self.seconds_high is None or not self.seconds > 0:
            return None
        return (self.seconds_high - self.seconds_low) / (2 * self.seconds)

    def samples_per_s(self, size: int) -> Optional[float]:
        return size / self.seconds if self.seconds > 0 else None

    def samples_per_s_interval(self, size: int) -> Optional[tuple[float, float]]:
        """``(size / seconds_high, size / seconds_low)``; ``None`` without an interval."""
        if self.seconds_low is None or self.seconds_high is None or not self.seconds_low > 0:
            return None
        return size / self.seconds_high, size / self.seconds_low

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Timing":
        return cls(int(data["repeats"]), float(data["seconds"]), data.get("seconds_low"), data.get("seconds_high"),
                   data.get("spread"), float(data["step_seconds"]), float(data["optimizer_seconds"]))

    @classmethod
    def single(cls, step_seconds: float, optimizer_seconds: float = 0.0) -> "Timing":
        """One step's times (no interval, no spread): what a caller gives that timed only once."""
        return cls(1, step_seconds + optimizer_seconds, None, None, None, step_seconds, optimizer_seconds)


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Optional[tuple[float, float]]:
    """Order-statistic interval ``[t_(k), t_(n+1−k)]`` for the median, ``k`` the largest with coverage
    ``1 − 2·P(B ≤ k − 1) ≥ confidence``, ``B ~ Binomial(n, ½)``; ``None`` if even ``k = 1`` falls short."""
    n, k = len(values), 0
    below = 0  # 2^n · P(B ≤ k − 1), exact integers
    while k + 1 <= n // 2:
        below_next = below + math.comb(n, k)  # 2^n · P(B ≤ k)
        if 1.0 - 2.0 * below_next / 2.0**n < confidence:
            break
        k, below = k + 1, below_next
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def block_medians(values: Sequence[float], blocks: int = BLOCKS) -> list[float]:
    """Medians of ``blocks`` consecutive, near-equal runs of ``values`` (each value its own block if fewer)."""
    n = len(values)
    m = min(n, blocks)
    edges = [round(i * n / m) for i in range(m + 1)]
    return [statistics.median(values[edges[i]: edges[i + 1]]) for i in range(m)]


def summarize(step_seconds: Sequence[float], optimizer_seconds: Sequence[float]) -> Timing:
    """A :class:`Timing` from paired per-repeat forward+backward and optimizer seconds (at least one), in the
    order they were measured."""
    if not step_seconds or len(step_seconds) != len(optimizer_seconds):
        raise ValueError("summarize needs one or more repeats, as many optimizer times as step times.")
    totals = [f + o for f, o in zip(step_seconds, optimizer_seconds)]
    median = statistics.median(totals)
    interval = median_interval(block_medians(totals))
    spread = None
    if len(totals) >= 2 and median > 0:
        q1, _, q3 = statistics.quantiles(totals, n=4, method="inclusive")
        spread = (q3 - q1) / median
    return Timing(len(totals), median, interval[0] if interval else None, interval[1] if interval else None, spread,
                  statistics.median(step_seconds), statistics.median(optimizer_seconds))


def precise_enough(timing: Timing, rel_precision: float) -> bool:
    """The median is known to within ``rel_precision`` (its interval's half-width over it)."""
    width = timing.rel_halfwidth
    return width is not None and width <= rel_precision


def faster(size_a: int, a: Timing, size_b: int, b: Timing) -> Optional[bool]:
    """Is micro-batch ``size_a`` faster (samples/s) than ``size_b`` beyond the measured noise?

    ``True``/``False`` when their intervals do not overlap, ``None`` when they do (or either has none): a
    difference inside the noise decides nothing.
    """
    ia, ib = a.samples_per_s_interval(size_a), b.samples_per_s_interval(size_b)
    if ia is None or ib is None:
        return None
    if ia[0] > ib[1]:
        return True
    if ia[1] < ib[0]:
        return False
    return None
