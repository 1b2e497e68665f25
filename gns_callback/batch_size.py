"""How many examples a batch holds, read off the batch itself (torch only, no Lightning).

A batch is any nesting of tuples, lists, dicts and dataclasses around tensors. Lightning's own
``extract_batch_size`` takes the first tensor's dim 0, which is wrong when a small metadata tensor comes first
(``(meta_3vec, x, y)`` reads 3). Here the size is the dim 0 shared by the most tensors (ties: the largest), and
``None`` when the batch holds no tensor with a dim (e.g. raw strings tokenized inside ``training_step``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch


def batch_size_of(batch: Any) -> Optional[int]:
    """The leading dimension most tensors in ``batch`` share (ties: the largest), or None if no tensor has one."""
    sizes = Counter(t.shape[0] for t in _tensors(batch) if t.ndim > 0)
    if not sizes:
        return None
    return max(sizes, key=lambda size: (sizes[size], size))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from _tensors(getattr(value, field.name))
