"""Cross-rank agreement, written once: every rank probes alone, then the ranks exchange one small vector.

The only collective is ``agree(values) -> values``, an element-wise MIN over ranks (the identity on one
process), passed in by the caller: ``torch.distributed``, a Lightning strategy's ``reduce``, or two threads in a
test. A maximum travels as the minimum of negatives. Each exchange carries one extra flag, ``−1`` from a rank
whose own probing raised: then every rank raises (that rank its own error, the others
:class:`ProbeFailedOnOtherRank`) at the same point, so none is left waiting in a collective the others never
reach. Composer's auto-microbatching showed why: a rank that retries after an OOM while the others wait
deadlocks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from gns_callback.probe.timing import Timing

#: ``agree(values) -> values``: element-wise minimum over ranks (identity on one process); every rank calls it
#: in step, with vectors of the same length.
Agree = Callable[[list[float]], list[float]]

#: Finite stand-in for −∞ (a value that dominates the minimum) in collectives.
NOTHING = -1e18

FITS, FAILED, NOT_TRIED = 1.0, 0.0, -1.0


class ProbeFailedOnOtherRank(RuntimeError):
    """Another rank hit a non-OOM error during the probe. Every rank raises (that rank its own error) once all
    have reached the same collective, so none is left waiting for the others."""


def single_process(values: list[float]) -> list[float]:
    """The agreement of one process with itself."""
    return list(values)


def agree_or_raise(agree: Agree, values: Sequence[float], error: Optional[BaseException]) -> list[float]:
    """``agree(values + [error flag])`` without the flag; raises if any rank's flag says it failed."""
    agreed = agree([float(v) for v in values] + [-1.0 if error is not None else 0.0])
    if agreed[-1] < 0:
        if error is not None:
            raise error
        raise ProbeFailedOnOtherRank("the probe failed on another rank (see that rank's error)")
    return agreed[:-1]


def as_largest(value: Optional[float]) -> float:
    """Encode ``value`` so that the MIN over ranks yields the largest (missing or non-finite counts as 0)."""
    return 0.0 if value is None or not math.isfinite(value) else -float(value)


def largest(encoded: float) -> float:
    """Decode :func:`as_largest`."""
    return -encoded


def _as_slowest(seconds: Optional[float]) -> float:
    """−seconds (MIN over ranks: the slowest); a rank without a time wins the MIN and makes it unknown."""
    return NOTHING if seconds is None or not math.isfinite(seconds) else -float(seconds)


def _slowest(encoded: float) -> Optional[float]:
    return None if encoded <= NOTHING / 2 else -encoded


class TimedOutcome(Protocol):
    """What one rank knows about one candidate: did it fit, and how long did it take (``timing``, or at least
    ``step_seconds`` and ``optimizer_seconds``)."""

    ok: bool
    step_seconds: Optional[float]
    optimizer_seconds: Optional[float]


@dataclass(frozen=True)
class AgreedOutcome:
    """A candidate as all ranks see it: it fits only if it fitted everywhere; its timing is the slowest rank's
    (field by field: medians, interval ends and spread the largest, repeats the fewest; ``None`` where any rank
    has none)."""

    ok: bool
    timing: Optional[Timing] = None


#: status, then −seconds, −low, −high, −spread, −step, −optimizer (largest over ranks), repeats (smallest)
_FIELDS = 8


def _timing_of(outcome: TimedOutcome) -> Optional[Timing]:
    timing = getattr(outcome, "timing", None)
    if timing is None and outcome.step_seconds is not None:
        timing = Timing.single(outcome.step_seconds, outcome.optimizer_seconds or 0.0)
    return timing


def _encode(outcome: Optional[TimedOutcome]) -> list[float]:
    if outcome is None:
        return [NOT_TRIED] + [0.0] * (_FIELDS - 1)
    timing = _timing_of(outcome) if outcome.ok else None
    if timing is None:
        return [FITS if outcome.ok else FAILED] + [NOTHING] * 6 + [0.0]
    slowest = [timing.seconds, timing.seconds_low, timing.seconds_high, timing.spread, timing.step_seconds,
               timing.optimizer_seconds]
    return [FITS] + [_as_slowest(v) for v in slowest] + [float(timing.repeats)]


def _decode(values: Sequence[float]) -> Optional[AgreedOutcome]:
    status, *slowest, repeats = values
    if status < FAILED - 0.5:
        return None
    if status < FITS - 0.5:
        return AgreedOutcome(False)
    seconds, low, high, spread, step, optimizer = (_slowest(v) for v in slowest)
    if seconds is None or step is None or optimizer is None:
        return AgreedOutcome(True)
    return AgreedOutcome(True, Timing(int(repeats), seconds, low, high, spread, step, optimizer))


def agree_outcomes(
    agree: Agree, outcomes: Sequence[Optional[TimedOutcome]], error: Optional[BaseException]
) -> list[Optional[AgreedOutcome]]:
    """One exchange for a list of candidates tried in the same order on every rank (``None``: not tried here).

    Returns, per candidate, ``None`` if some rank did not try it, else its :class:`AgreedOutcome`.
    """
    values = [v for outcome in outcomes for v in _encode(outcome)]
    agreed = agree_or_raise(agree, values, error)
    return [_decode(agreed[i: i + _FIELDS]) for i in range(0, len(agreed), _FIELDS)]
