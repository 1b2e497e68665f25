"""How many bytes a training step needs: CUDA's allocator peak, or an accounting that works on any device.

The accounting (used on CPU, so that CI can test the probe) is

    bytes = params + grads + optimizer state + peak of the tensors saved for backward

each counted once per storage (views of one storage, e.g. ``weight.t()`` saved by ``addmm``, count once, and
saved parameters are not counted twice). Saved tensors are seen through
``torch.autograd.graph.saved_tensors_hooks``: they are exactly the activations autograd keeps from forward to
backward, the part of memory that grows with the batch. Transient buffers (freed within an op) are not
counted, so this is a model of a step's peak, not a measurement of the process's resident memory; on CUDA use
the allocator's own peak (``torch.cuda.max_memory_allocated``) instead.
"""

from __future__ import annotations

import os
from typing import Any, Hashable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor


class OverBudget(Exception):
    """Raised from inside forward when the saved tensors alone already exceed the budget (a simulated OOM)."""


def storage_of(tensor: Tensor) -> Optional[tuple[Hashable, int]]:
    """``(key, nbytes)`` of the storage behind ``tensor`` (shared by all its views), ``None`` if it has none."""
    try:
        storage = tensor.untyped_storage()
        pointer, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a storage
        return ("id", id(tensor)), tensor.numel() * tensor.element_size()
    if pointer == 0 or nbytes == 0:  # empty or meta tensors
        return None
    return (tensor.device.type, tensor.device.index, pointer), nbytes


def unique_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[Hashable, int] = {}
    for tensor in tensors:
        found = storage_of(tensor)
        if found is not None:
            seen[found[0]] = max(seen.get(found[0], 0), found[1])
    return sum(seen.values())


def _tensors_in(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)


def static_tensors(params: Sequence[Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[Tensor]:
    """Parameters, their ``.grad`` and every tensor in the optimizers' state (Adam: exp_avg, exp_avg_sq, step)."""
    for p in params:
        yield p
        if p.grad is not None:
            yield p.grad
    for optimizer in optimizers:
        for state in optimizer.state.values():
            yield from _tensors_in(state)


def static_bytes(params: Sequence[Tensor], optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """The batch-independent part: ``params + grads + optimizer state`` bytes, unique storages."""
    return unique_bytes(static_tensors(params, optimizers))


class _Packed:
    """What autograd stores instead of a saved tensor while metered: the tensor itself, plus a finaliser that
    tells the meter when autograd lets go of it (after that tensor's backward, or when the graph is freed)."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: Tensor, meter: "SavedTensorsMeter", key: Optional[Hashable]) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._release(self.key)


class SavedTensorsMeter:
    """Peak bytes of the distinct storages autograd holds for backward while the context is active.

    A storage counts once however many views of it are saved, from when it is first saved until autograd
    releases the last of them: per-chunk backward (``batch_split_factor``, gradient checkpointing) lowers the
    peak as it does on a device.

    Args:
        exclude: storage keys not to count (the parameters', already in :func:`static_bytes`).
        abort_above: raise :class:`OverBudget` as soon as the live bytes exceed this, so a size that cannot fit
            stops early instead of running (and allocating) the whole step.
    """

    def __init__(self, exclude: Iterable[Hashable] = (), abort_above: Optional[float] = None) -> None:
        self.exclude = set(exclude)
        self.abort_above = abort_above
        self._live: dict[Hashable, list[int]] = {}  # key -> [references, nbytes]
        self.live_bytes = 0
        self.saved_bytes = 0  # the peak of live_bytes
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None

    def _pack(self, tensor: Tensor) -> _Packed:
        found = storage_of(tensor)
        if found is None or found[0] in self.exclude:
            return _Packed(tensor, self, None)
        key, nbytes = found
        entry = self._live.setdefault(key, [0, 0])
        entry[0] += 1
        if nbytes > entry[1]:
            self.live_bytes += nbytes - entry[1]
            entry[1] = nbytes
            self.saved_bytes = max(self.saved_bytes, self.live_bytes)
            if self.abort_above is not None and self.live_bytes > self.abort_above:
                raise OverBudget(f"saved tensors alone exceed the budget ({self.live_bytes} bytes)")
        return _Packed(tensor, self, key)

    def _release(self, key: Hashable) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            self.live_bytes -= entry[1]
            del self._live[key]

    @staticmethod
    def _unpack(packed: _Packed) -> Tensor:
        return packed.tensor

    def __enter__(self) -> "SavedTensorsMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc_info)
        self._hooks = None


def cuda_peak_start(device: torch.device) -> None:
    """Reset the allocator's peak so :func:`cuda_peak_bytes` measures one trial."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def cuda_peak_bytes(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


def system_available_bytes() -> Optional[int]:
    """Available system memory: ``psutil`` if installed, else ``MemAvailable`` from ``/proc/meminfo``."""
    try:
        import psutil  # optional; not a dependency

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def device_budget_bytes(device: torch.device) -> Optional[int]:
    """What a step on ``device`` may use: CUDA's free memory plus what this process's allocator already holds
    (it reuses its cache); elsewhere the available system memory. ``None`` when unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    return system_available_bytes()
