"""Hardware-friendly global batch sizes and their split into ``micro × accumulate × devices``.

Sizes are searched outward from the target (nearest first, ties going up) on a grid — powers of two when asked
(that are also multiples of ``multiple_of``), else multiples of ``multiple_of`` — inside ``[lo, hi]``. The per-device
share ``s = B/devices`` must be an integer, and is one micro-batch (``s ≤ micro_cap``) or several equal ones:

1. strict: the nearest size within 10% of the nearest grid size that splits into the fewest possible micro-batches,
   ``a = ceil(s/micro_cap)`` (the micro-batch stays close to the fastest size);
2. relaxed: the nearest size whose share has a divisor in ``(micro_cap/2, micro_cap]`` (powers of two always do);
3. the same on a coarser fallback grid: multiples of ``multiple_of``, then any integer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, NamedTuple, Optional, Protocol, Sequence

_MAX_CANDIDATES = 200_000


class ProbeSummary(Protocol):
    """What :func:`recommend` reads from a memory/throughput probe (duck-typed; its ``to_dict()`` works too).

    ``throughput``: ``{size: samples/s}`` or a list of ``{"size", "samples_per_s"}`` (optional; else taken from the
    trials). ``trials`` entries: ``(size, ok, bytes, samples_per_sec)`` tuples, or dicts/objects with ``size``,
    ``ok``, ``bytes``/``measured_bytes`` and ``samples_per_sec``/``samples_per_s``.
    """

    max_micro_batch: int
    trials: Sequence[Any]


@dataclass(frozen=True)
class Trial:
    size: int
    ok: bool
    bytes: Optional[float]
    samples_per_sec: Optional[float]
    split: Optional[int] = None


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _first(obj: Any, *names: str) -> Any:
    for name in names:
        v = _get(obj, name)
        if v is not None:
            return v
    return None


def _float(v: Any) -> Optional[float]:
    return None if v is None else float(v)


def parse_trial(trial: Any) -> Trial:
    """One probe trial from a tuple/list ``(size, ok, bytes, samples_per_sec)``, a dict or an object."""
    if isinstance(trial, (tuple, list)):
        size, ok, nbytes, sps = (list(trial) + [None] * 4)[:4]
        return Trial(int(size), bool(ok), _float(nbytes), _float(sps))
    ok = _get(trial, "ok", True)
    return Trial(
        int(_first(trial, "size", "micro_batch")),
        bool(True if ok is None else ok),
        _float(_first(trial, "bytes", "measured_bytes")),
        _float(_first(trial, "samples_per_sec", "samples_per_s")),
        _get(trial, "split"),
    )


def probe_throughput(probe: Any) -> dict[int, float]:
    """``{micro: samples/s}`` from a probe: its ``throughput`` (a dict or a list of ``{"size", "samples_per_s"}``)
    when present, else its successful, timed trials (split-search trials with a split factor > 1 left out)."""
    if probe is None:
        return {}
    table: dict[int, float] = {}
    given = _get(probe, "throughput")
    if isinstance(given, Mapping):
        table = {int(k): float(v) for k, v in given.items() if v is not None}
    elif given:
        for row in given:
            v = _first(row, "samples_per_s", "samples_per_sec")
            if v is not None:
                table[int(_first(row, "size", "micro_batch"))] = float(v)
    if not table:
        for raw in _get(probe, "trials", None) or ():
            t = parse_trial(raw)
            if t.ok and t.samples_per_sec is not None and (t.split or 1) == 1:
                table[t.size] = t.samples_per_sec
    return {k: v for k, v in table.items() if math.isfinite(v) and v > 0}


class ProbeView(NamedTuple):
    """What a recommendation reads from a probe: the largest micro-batch that fits the memory budget (``None``:
    unknown) and ``{micro: samples/s per device}`` for the sizes that fit and were timed (empty: not timed)."""

    max_micro_batch: Optional[int]
    throughput: dict[int, float]


def probe_inputs(probe: Any) -> ProbeView:
    """The one typed view of a probe result (object, its ``to_dict()``, or a duck; ``None``: nothing known).

    Every read of the probe by the recommendation goes through here, so a change in the probe's format is
    handled in this one place.
    """
    if probe is None:
        return ProbeView(None, {})
    max_micro = _get(probe, "max_micro_batch")
    return ProbeView(None if max_micro is None else int(max_micro), probe_throughput(probe))


def preferred_micro(
    max_micro_batch: Optional[int], throughput: Mapping[int, float], current_micro: Optional[int]
) -> tuple[Optional[int], str]:
    """The micro-batch cap to split with, and where it came from.

    The measured size with the highest throughput among those that fit (``≤ max_micro_batch``; ties → larger);
    without a table, ``max_micro_batch``; without a probe, the current micro-batch (known to fit); else ``None``
    (no cap: one micro-batch per device).
    """
    fits = {
        int(s): float(v)
        for s, v in throughput.items()
        if v is not None and math.isfinite(v) and v > 0 and (max_micro_batch is None or s <= max_micro_batch)
    }
    if fits:
        best = max(fits, key=lambda s: (fits[s], s))
        return best, f"fastest measured micro-batch that fits ({best}: {fits[best]:.4g} samples/s per device)"
    if max_micro_batch is not None:
        return max_micro_batch, f"largest micro-batch that fits ({max_micro_batch}, from the memory probe)"
    if current_micro is not None:
        return current_micro, f"current micro-batch ({current_micro}; no probe)"
    return None, "no probe and no current micro-batch: one micro-batch per device"


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def split(
    global_batch: int, num_devices: int, micro_cap: Optional[int], *, strict: bool = True
) -> Optional[tuple[int, int]]:
    """``(micro, accumulate)`` with ``micro·accumulate·devices = global_batch`` and ``micro ≤ micro_cap``, or ``None``.

    ``strict``: the fewest accumulation steps possible, ``a = ceil(share/micro_cap)`` equal micro-batches (so the
    micro-batch stays within ``(cap·(a−1)/a, cap]``). Otherwise: the largest divisor of the share in
    ``(cap/2, cap]`` (always exists for a power-of-two share and ``cap ≥ 1``).

    >>> split(256, 2, 64), split(256, 1, 48), split(264, 1, 48), split(256, 1, 48, strict=False), split(12, 8, None)
    ((64, 2), None, (44, 6), (32, 8), None)
    """
    if global_batch <= 0 or global_batch % num_devices:
        return None
    share = global_batch // num_devices
    if micro_cap is None or share <= micro_cap:
        return share, 1
    if strict:
        accumulate = math.ceil(share / micro_cap)
        return None if share % accumulate else (share // accumulate, accumulate)
    fitting = [d for d in _divisors(share) if micro_cap / 2 < d <= micro_cap]
    return (fitting[-1], share // fitting[-1]) if fitting else None


def split_keeping(global_batch: int, num_devices: int, micro_cap: Optional[int]) -> Optional[tuple[int, int]]:
    """Split an exact size (the batch being kept): the largest divisor of the per-device share ``≤ micro_cap``."""
    if global_batch <= 0 or global_batch % num_devices:
        return None
    share = global_batch // num_devices
    if micro_cap is None or share <= micro_cap:
        return share, 1
    micro = max(d for d in range(1, min(micro_cap, share) + 1) if share % d == 0)
    return micro, share // micro


def candidates(target: float, lo: int, hi: float, step: int, power_of_two: bool = False) -> Iterator[int]:
    """Grid sizes in ``[lo, hi]`` nearest ``target`` first (absolute distance; log distance for powers of two).

    >>> list(candidates(100, 1, 1000, 8))[:4], list(candidates(100, 1, 1000, 8, power_of_two=True))[:3]
    ([104, 96, 112, 88], [128, 64, 256])
    """
    target = max(float(target), 1e-12)
    if power_of_two:
        exps = [e for e in range(0, 63) if lo <= 2**e <= hi and (2**e) % step == 0]
        yield from (2**e for e in sorted(exps, key=lambda e: (abs(e - math.log2(target)), -e)))
        return
    k_lo = math.ceil(lo / step)
    k_hi = math.floor(hi / step) if math.isfinite(hi) else k_lo + _MAX_CANDIDATES
    if k_lo > k_hi:
        return
    k0 = min(max(math.floor(target / step + 0.5), k_lo), k_hi)
    down, up = k0 - 1, k0 + 1
    yield k0 * step
    for _ in range(_MAX_CANDIDATES):
        can_down, can_up = down >= k_lo, up <= k_hi
        if not (can_down or can_up):
            return
        if can_up and (not can_down or abs(up * step - target) <= abs(target - down * step)):
            yield up * step
            up += 1
        else:
            yield down * step
            down -= 1
