"""What the hardware allows: the micro-batch cap to split with, and the throughput table for time predictions.

The probe is read only through :func:`~gns_callback.recommendation.sizing.probe_inputs` (one typed view);
explicit ``max_micro_batch``/``throughput`` arguments override it.

Accumulation only when memory requires it: ``micro × accumulate`` processes the same examples as one micro-batch
of the product, in more, smaller passes, so it never gains throughput. Without a memory measurement the batch is
one micro-batch per device, unless the user already accumulates (then memory presumably limits the micro-batch,
and the current one stays the cap). When the micro-batch grows without a measurement, a note says how to check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gns_callback.recommendation.current import CurrentSetup
from gns_callback.recommendation.sizing import preferred_micro, probe_inputs, split_keeping


@dataclass(frozen=True)
class Hardware:
    """``micro_cap``: the largest micro-batch to use (``None``: no cap, one micro-batch per device);
    ``throughput``: ``{micro: samples/s per device}`` (empty when not measured); ``notes``: where they came from."""

    micro_cap: Optional[int]
    throughput: dict[int, float]
    notes: tuple[str, ...]
    measured: bool = True


def read_hardware(
    probe: Any,
    max_micro_batch: Optional[int],
    throughput: Optional[Mapping[int, float]],
    current: CurrentSetup,
) -> Hardware:
    """The micro-batch cap: the fastest measured size that fits, else the memory limit, else the current
    micro-batch (known to fit; see :func:`~gns_callback.recommendation.sizing.preferred_micro`). Nothing
    measured: see :func:`unmeasured`."""
    if probe is None and max_micro_batch is None and throughput is None:
        return unmeasured(current)
    view = probe_inputs(probe)
    notes: list[str] = []
    max_micro = max_micro_batch if max_micro_batch is not None else view.max_micro_batch
    if max_micro is not None and max_micro < 1:
        notes.append("the probe found no micro-batch that fits the memory budget: its limit is ignored")
        max_micro = None
    table = {int(k): float(v) for k, v in (throughput if throughput is not None else view.throughput).items()}
    cap, source = preferred_micro(max_micro, table, current.micro_batch_size)
    if cap is not None and max_micro is not None and cap > max_micro:
        cap = max_micro
    notes.append(f"micro-batch cap: {source}")
    return Hardware(cap, table, tuple(notes))


def unmeasured(current: CurrentSetup) -> Hardware:
    """No probe: no cap (one micro-batch per device), unless the user already accumulates."""
    micro, accum = current.micro_batch_size, current.accumulate
    if micro is not None and accum is not None and accum > 1:
        note = (
            f"micro-batch cap: the current micro-batch ({micro}; no probe): you accumulate {accum} micro-batches, "
            "so memory presumably limits it"
        )
        return Hardware(micro, {}, (note,), measured=False)
    note = "micro-batch: one per device, no accumulation (memory not measured; accumulating gains no throughput)"
    return Hardware(None, {}, (note,), measured=False)


def fit_advice(hardware: Hardware, current: CurrentSetup, batch_size: int, micro_batch_size: int) -> tuple[str, ...]:
    """A note when the micro-batch grows past the current one without a memory measurement: how to find out
    whether it fits, and the split to use if it does not."""
    known = current.micro_batch_size
    if hardware.measured or (known is not None and micro_batch_size <= known):
        return ()
    grown = f"grows from {known} to {micro_batch_size}" if known is not None else f"is {micro_batch_size}"
    note = (
        f"memory not measured: the micro-batch {grown} per device. To check that it fits, run the memory probe "
        "(the callback's probe=True) or pass max_micro_batch= / probe= here"
    )
    fallback = None if known is None else split_keeping(batch_size, current.num_devices, known)
    if fallback is not None and fallback[1] > 1 and 2 * fallback[0] > known:
        note += f"; if it does not fit, split as micro-batch {fallback[0]} × accumulate {fallback[1]}"
    elif known is not None:
        note += f"; if it does not fit, pass max_micro_batch={known} for a split that does"
    return (note,)
