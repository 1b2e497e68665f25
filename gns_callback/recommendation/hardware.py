"""What the hardware allows: the micro-batch cap to split with, and the throughput table for time predictions.

The probe is read only through :func:`~gns_callback.recommendation.sizing.probe_inputs` (one typed view);
explicit ``max_micro_batch``/``throughput`` arguments override it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gns_callback.recommendation.sizing import preferred_micro, probe_inputs


@dataclass(frozen=True)
class Hardware:
    """``micro_cap``: the largest micro-batch to use (``None``: no cap, one micro-batch per device);
    ``throughput``: ``{micro: samples/s per device}`` (empty when not measured); ``notes``: where they came from."""

    micro_cap: Optional[int]
    throughput: dict[int, float]
    notes: tuple[str, ...]


def read_hardware(
    probe: Any,
    max_micro_batch: Optional[int],
    throughput: Optional[Mapping[int, float]],
    current_micro: Optional[int],
) -> Hardware:
    """The micro-batch cap: the fastest measured size that fits, else the memory limit, else the current
    micro-batch (known to fit), else none (see :func:`~gns_callback.recommendation.sizing.preferred_micro`)."""
    view = probe_inputs(probe)
    notes: list[str] = []
    max_micro = max_micro_batch if max_micro_batch is not None else view.max_micro_batch
    if max_micro is not None and max_micro < 1:
        notes.append("the probe found no micro-batch that fits the memory budget: its limit is ignored")
        max_micro = None
    table = {int(k): float(v) for k, v in (throughput if throughput is not None else view.throughput).items()}
    cap, source = preferred_micro(max_micro, table, current_micro)
    if cap is not None and max_micro is not None and cap > max_micro:
        cap = max_micro
    measured = probe is not None or max_micro_batch is not None or throughput is not None
    notes.append(f"micro-batch cap: {source}" if measured else f"micro-batch: {source}")
    return Hardware(cap, table, tuple(notes))
