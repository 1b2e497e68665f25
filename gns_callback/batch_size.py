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


def first_half_rows(batch_size: int, device: torch.device) -> torch.Tensor:
    """The row index ``0, 1, …, h−1, 0, 1, …, h−1`` (then ``2h`` where ``batch_size`` is odd), ``h = batch_size // 2``:
    the second half's rows replaced by the first half's."""
    half = batch_size // 2
    index = torch.arange(batch_size, device=device)
    index[half: 2 * half] = torch.arange(half, device=device)
    return index


def first_half_copied(batch: Any, batch_size: int) -> tuple[Any, bool]:
    """``batch`` with rows ``h..2h`` of every tensor whose dim 0 holds ``batch_size`` replaced by rows ``0..h``
    (``h = batch_size // 2``), as a new batch of the same nesting (the input is not changed); and whether any
    tensor was. The per-example check (:mod:`gns_callback.per_example.checks`) runs the training step on it: mixing
    the examples before the model (mixup, CutMix in ``training_step``) then changes the first half's gradients."""
    changed: list[bool] = []

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or value.shape[0] != batch_size or batch_size < 2:
                return value
            changed.append(True)
            return value.index_select(0, first_half_rows(batch_size, value.device))
        if isinstance(value, Mapping):
            return type(value)({key: copy(item) for key, item in value.items()}) if isinstance(value, dict) else value
        if isinstance(value, tuple):
            items = [copy(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, list):
            return [copy(item) for item in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: copy(getattr(value, f.name)) for f in dataclasses.fields(value)
                                                 if f.init})
        return value

    return copy(batch), bool(changed)
