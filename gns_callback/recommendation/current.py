"""The configuration a recommendation starts from: ``global batch = micro × accumulate × devices``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class CurrentSetup:
    """The current split; ``micro_batch_size``/``accumulate`` are ``None`` when they cannot be derived."""

    batch_size: int
    micro_batch_size: Optional[int]
    accumulate: Optional[int]
    num_devices: int


def read_current(
    batch_size: int, num_devices: int, micro_batch_size: Optional[int], accumulate: Optional[int]
) -> CurrentSetup:
    """The current split from what is known: the micro-batch as given, else ``batch/(accumulate·devices)`` when
    that divides, else ``batch/devices``; the accumulation as given, else ``round(batch/(micro·devices))``.

    >>> read_current(128, 2, None, 2)
    CurrentSetup(batch_size=128, micro_batch_size=32, accumulate=2, num_devices=2)
    >>> read_current(96, 1, 32, None)
    CurrentSetup(batch_size=96, micro_batch_size=32, accumulate=3, num_devices=1)
    """
    micro = micro_batch_size
    if micro is None and accumulate:
        share, rem = divmod(batch_size, accumulate * num_devices)
        micro = share if not rem and share else None
    if micro is None and batch_size % num_devices == 0:
        micro = batch_size // num_devices
    accum = accumulate
    if accum is None and micro:
        accum = max(1, round(batch_size / (micro * num_devices)))
    return CurrentSetup(batch_size, micro, accum, num_devices)
