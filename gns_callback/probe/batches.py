"""A real batch tiled to any micro-batch size (memory depends on shapes, not values), and moved to a device."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from gns_callback import batch_size as examples


def map_tensors(batch: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor inside dicts, lists, tuples, named tuples and dataclasses."""
    if isinstance(batch, Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        items = [(key, map_tensors(value, fn)) for key, value in batch.items()]
        if isinstance(batch, defaultdict):
            return type(batch)(batch.default_factory, items)
        return type(batch)(items)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        return type(batch)(*(map_tensors(value, fn) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(value, fn) for value in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {f.name: map_tensors(getattr(batch, f.name), fn) for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **changes)
    return batch


def batch_size_of(batch: Any) -> int:
    """The examples in ``batch``: the dim 0 more of its tensors share than any other
    (:func:`gns_callback.batch_size.batch_size_of`; the first tensor's dim 0 would read 3 for ``(meta_3vec, x, y)``
    and tile only the metadata). Raises ``ValueError`` where that can't be told."""
    size = examples.batch_size_of(batch)
    if size is None:
        raise ValueError(
            "the probe can't tell how many examples the batch holds: it has no tensor with a dim, or its tensors' "
            "dim 0 sizes tie with no majority (e.g. (x, meta_3vec), or tokens (B, T) beside labels flattened to "
            "(B·T,)). Pass batch_size, or let most of the batch's tensors hold the examples in dim 0.")
    return size


def resize_batch(batch: Any, size: int, batch_size: Optional[int] = None) -> Any:
    """``batch`` with every tensor whose dim 0 is the batch size tiled (or cut) to ``size`` rows.

    Memory depends on shapes, not values, so repeating real samples is enough. The result is a fresh contiguous
    tensor of exactly ``size`` rows (``index_select``), so saved-tensor storages grow exactly linearly.
    """
    n = batch_size_of(batch) if batch_size is None else batch_size

    def resize(tensor: Tensor) -> Tensor:
        if tensor.ndim == 0 or tensor.shape[0] != n:
            return tensor
        index = torch.arange(size, device=tensor.device) % n
        return tensor.index_select(0, index)

    return map_tensors(batch, resize)


def move_batch(batch: Any, device: torch.device) -> Any:
    """Every tensor in ``batch`` on ``device``."""
    return map_tensors(batch, lambda t: t.to(device))
