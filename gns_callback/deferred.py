"""Device values read on the host a step late, in order, without making the host wait for the device.

The meter's per-step bookkeeping (step estimates, blend, recent estimate, run average, critical-batch sums) is a
few dozen scalar operations. On the host they cost microseconds; as 0-d device tensors each one is a kernel
launch, about 5–10 µs of host time on a GPU, and on a GPU the host is what small and medium models wait for
(benchmarks/RESULTS.md, "GPU: overhead of the callback"). So each step's dozen numbers are copied to pinned host
memory with ``non_blocking=True``, an event is recorded behind the copy, and the copy is read when the next step
is measured or a result is read. The device runs in stream order, so by the next step the event has normally
completed; waiting on it never waits for work queued after it (the optimizer step, the next forward pass).
Torch only, no Lightning.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Generic, Iterator, Optional, TypeVar

import torch

T = TypeVar("T")


@dataclass
class _Pending(Generic[T]):
    values: torch.Tensor  # on the host (pinned when copied from CUDA)
    ready: Optional[torch.cuda.Event]  # recorded behind the copy; None: already on the host
    context: T


def to_host_later(vector: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
    """``(host copy, event)``: a non-blocking copy into pinned memory and the event recorded behind it on CUDA;
    on the CPU the vector itself and no event; elsewhere a blocking copy."""
    if vector.device.type == "cpu":
        return vector.detach(), None
    if vector.device.type != "cuda":
        return vector.detach().cpu(), None
    host = torch.empty(vector.shape, dtype=vector.dtype, pin_memory=True)
    host.copy_(vector.detach(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class DeferredReads(Generic[T]):
    """A queue of device vectors on their way to the host, each with the ``context`` needed to use it."""

    def __init__(self) -> None:
        self._queue: deque[_Pending[T]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, vector: torch.Tensor, context: T) -> None:
        """Start copying ``vector`` (a 1-d tensor) to the host; it is read by :meth:`pop`."""
        values, ready = to_host_later(vector)
        self._queue.append(_Pending(values, ready, context))

    def pop(self, keep: int = 0) -> Iterator[tuple[list[float], T]]:
        """The oldest vectors as host floats with their contexts, in push order, leaving the newest ``keep``
        in flight (waiting for a copy only if the device has not finished it yet)."""
        while len(self._queue) > keep:
            pending = self._queue.popleft()
            if pending.ready is not None:
                pending.ready.synchronize()
            yield pending.values.tolist(), pending.context

    def clear(self) -> None:
        self._queue.clear()
