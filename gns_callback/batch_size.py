"""How many examples a batch holds, read off the batch itself (torch only, no Lightning).

A batch is any nesting of tuples, lists, dicts and dataclasses around tensors. Lightning's own
``extract_batch_size`` takes the first tensor's dim 0, which is wrong when a small metadata tensor comes first
(``(meta_3vec, x, y)`` reads 3). Here the size is the dim 0 shared by more tensors than any other size, and ``None``
when it can't be told: no tensor with a dim (e.g. raw strings tokenized inside ``training_step``), or a tie between
different sizes (``(meta_3vec, x)``; so is ``(tokens (B, T), labels (B·T,))``). A ``None`` is never guessed:
``micro_batch`` then stops measuring with the reason, and ``per_example`` reads the size off its layers.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any, Iterator, Optional

import torch


def batch_size_of(batch: Any) -> Optional[int]:
    """The leading dimension more tensors in ``batch`` share than any other, or None (no such tensor, or a tie)."""
    ranked = Counter(t.shape[0] for t in _tensors(batch) if t.ndim > 0).most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return int(ranked[0][0])


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
