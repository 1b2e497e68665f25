"""How many examples a batch holds, read off the batch itself (torch only, no Lightning).

A batch is any nesting of tuples, lists, dicts and dataclasses around tensors. Lightning's own
``extract_batch_size`` takes the first tensor's dim 0, which is wrong when a small metadata tensor comes first
(``(meta_3vec, x, y)`` reads 3). Here the size is the dim 0 shared by more tensors than any other size, and ``None``
when it can't be told: no tensor with a dim (e.g. raw strings tokenized inside ``training_step``), or a tie between
different sizes (``(meta_3vec, x)``; so is ``(tokens (B, T), labels (B·T,))``). A ``None`` is never guessed:
``micro_batch`` then stops measuring with the reason, and ``per_example`` reads the size off its layers.

A list or tuple inside the batch holding 3 or more tensors of one dtype and one number of dims may hold one tensor
per example (``collate_fn=lambda b: tuple(zip(*b))`` over sequences padded in the model): its length is then the
batch size, and its tensors' dim 0 their lengths, which must not vote. It is read as examples where the rest of the
batch holds its length, or where its tensors' dim 0 differ (a collated batch's fields share theirs) and the rest does
not hold their common one; as fields (each tensor a vote, as before) where the rest of the batch holds their dim 0;
and where its tensors all have one dim 0 other than its length that nothing else holds, the size can't be told.
Before, 32 token sequences cut to 16 tokens read 16 examples, and every layer's input ``(32, 16, ...)`` was
measured along dim 1, as if sequence-first: B_simple read 19.2 (95% CI 18.1–20.4) against an exact 44.8. The batch
itself is read as fields: ``(tokens_flat (N,), offsets (B,), labels (B,))`` holds B examples.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
from collections import Counter
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import torch


def batch_size_of(batch: Any) -> Optional[int]:
    """The leading dimension more tensors in ``batch`` share than any other, or None (no such tensor, or a tie);
    a list of one tensor per example counts once, for its length (module docstring)."""
    votes: Counter = Counter()
    lists: list[list[torch.Tensor]] = []
    for item in list(batch) if isinstance(batch, (list, tuple)) else [batch]:  # the batch's own items are fields
        _collect(item, votes, lists)
    outside = set(votes)
    for tensors in lists:
        read = _read_list(tensors, outside)
        if read is None:
            return None
        votes.update(read)
    ranked = votes.most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return int(ranked[0][0])


#: Elements of each tensor that :func:`batch_fingerprint` weighs one by one (evenly spaced; all of a small tensor).
FINGERPRINT_SAMPLES = 4096


def batch_fingerprint(batch: Any, device: Optional[torch.device] = None) -> torch.Tensor:
    """Three float64 numbers that two copies of ``batch`` share and two different batches almost never do: the
    tensors' element count, their sum, and a position-weighted sum of up to :data:`FINGERPRINT_SAMPLES` evenly
    spaced elements of each (so that reordered rows differ too). On ``device`` (default: the first tensor's); zeros
    for a batch without tensors."""
    tensors = [t.detach() for t in _tensors(batch) if t.numel() and not t.is_complex() and t.layout == torch.strided]
    device = device or (tensors[0].device if tensors else torch.device("cpu"))
    total = torch.zeros(3, dtype=torch.float64, device=device)
    for t in tensors:
        flat = t.reshape(-1)
        picked = torch.linspace(0, flat.numel() - 1, min(flat.numel(), FINGERPRINT_SAMPLES), device=flat.device).long()
        weights = 1.0 + torch.arange(picked.numel(), dtype=torch.float64, device=flat.device).remainder(97)
        parts = torch.stack([torch.tensor(float(flat.numel()), dtype=torch.float64, device=flat.device),
                             flat.sum(dtype=torch.float64), (flat[picked].to(torch.float64) * weights).sum()])
        total += parts.to(device)
    return total


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor ``value`` holds, depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    for item in _children(value):
        yield from _tensors(item)


def _collect(value: Any, votes: Counter, lists: list[list[torch.Tensor]]) -> None:
    """Count the dim 0 of every tensor in ``value`` into ``votes``, and keep aside the lists that may hold one tensor
    per example (:func:`_may_hold_examples`), whose reading depends on the rest of the batch."""
    if isinstance(value, (list, tuple)) and _may_hold_examples(value):
        lists.append(list(value))
        return
    if isinstance(value, torch.Tensor):
        votes.update([value.shape[0]] if value.ndim > 0 else [])
    for item in _children(value):
        _collect(item, votes, lists)


def _children(value: Any) -> list[Any]:
    """The items a container holds (none for a tensor or anything else)."""
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, field.name) for field in dataclasses.fields(value)]
    return []


def _may_hold_examples(items: Any) -> bool:
    """3 or more tensors, of one dtype and one number of dims: one per example, or fields of the batch."""
    return (len(items) >= 3 and all(isinstance(t, torch.Tensor) for t in items)
            and len({(t.dtype, t.ndim) for t in items}) == 1)


def _read_list(tensors: list[torch.Tensor], outside: set) -> Optional[list[int]]:
    """The votes of a list of :func:`_may_hold_examples`: ``[len]`` where it holds the examples, each tensor's dim 0
    where they are fields, None where it can't be told. ``outside``: the sizes the rest of the batch holds."""
    if tensors[0].ndim == 0:
        return [len(tensors)]  # scalars: one per example
    lengths = [t.shape[0] for t in tensors]
    common = Counter(lengths).most_common(1)[0][0]
    if common == len(tensors):
        return lengths  # either reading gives its length
    if len(tensors) in outside:
        return [len(tensors)]
    if common in outside:
        return lengths
    if len(set(lengths)) > 1:
        return [len(tensors)]  # varying lengths: a collated batch's fields share their dim 0
    return None


def first_half_rows(batch_size: int, device: torch.device, from_first_row: bool = False) -> torch.Tensor:
    """The row index ``0, 1, …, h−1, 0, 1, …, h−1`` (then ``2h`` where ``batch_size`` is odd), ``h = batch_size // 2``:
    the second half's rows replaced by the first half's. ``from_first_row``: ``0, 1, …, h−1, 0, 0, …, 0`` instead,
    every row of the second half a copy of row 0.

    Two patterns, because one can leave a statistic of the batch as it was: ``pos_weight`` = negatives / positives
    of the batch is unchanged by the first wherever the halves hold as many positives, and by the second wherever
    the second half's labels are all row 0's; both at once only where the first half's and the whole batch's
    counts agree with a half of row 0's (no positives in the first half, or a batch of one class), and then no
    first-half example's gradient could move with it (:mod:`gns_callback.per_example.checks`)."""
    half = batch_size // 2
    index = torch.arange(batch_size, device=device)
    index[half: 2 * half] = 0 if from_first_row else torch.arange(half, device=device)
    return index


def first_half_copied(batch: Any, batch_size: int, from_first_row: bool = False) -> tuple[Any, bool]:
    """``batch`` with rows ``h..2h`` of every tensor whose dim 0 holds ``batch_size`` replaced by rows ``0..h``
    (``h = batch_size // 2``; ``from_first_row``: each by row 0, :func:`first_half_rows`), as a new batch of the same
    nesting (the input is not changed); and whether any tensor was. The per-example check
    (:mod:`gns_callback.per_example.checks`) runs the training step on it: mixing the examples before the model
    (mixup, CutMix in ``training_step``) then changes the first half's gradients. A batch that can't be rebuilt
    comes back as it is, with ``False``: the check must never stop the user's fit."""
    if batch_size < 2:
        return batch, False
    return rows_taken(batch, batch_size, first_half_rows(batch_size, torch.device("cpu"), from_first_row))


def rows_taken(batch: Any, batch_size: int, index: torch.Tensor) -> tuple[Any, bool]:
    """``batch`` with every tensor whose dim 0 holds ``batch_size`` replaced by its rows ``index`` (any length: the
    first ``h`` rows, or them twice), as a new batch of the same nesting (the input is not changed); and whether any
    tensor was. A batch that can't be rebuilt comes back as it is, with ``False``."""
    changed: list[bool] = []

    def copy(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or value.shape[0] != batch_size:
                return value
            changed.append(True)
            return value.index_select(0, index.to(value.device))
        if isinstance(value, Mapping):
            return _mapping_copied(value, copy, changed)
        if isinstance(value, tuple):
            items = [copy(item) for item in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, list):
            return [copy(item) for item in value]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: copy(getattr(value, f.name)) for f in dataclasses.fields(value)
                                                 if f.init})
        return value

    try:
        return copy(batch), bool(changed)
    except Exception:  # a container that can't be rebuilt (a tuple type with another constructor, say): none copied,
        return batch, False  # and the check copies rows at the first measured layer instead


def _mapping_copied(value: Mapping, copy: Callable[[Any], Any], changed: list[bool]) -> Mapping:
    """``value`` with each item passed through ``copy``: a plain ``dict`` rebuilt, any other mapping (``OrderedDict``,
    ``defaultdict``, Hugging Face's ``BatchEncoding`` and ``BatchFeature``, a ``UserDict``) shallow-copied with
    ``copy.copy`` and its items set on the copy. Where that fails, or the copy shares its items with ``value`` (setting
    them would change the user's batch), ``value`` is put back as it was and returned unchanged, its tensors not
    counted in ``changed``."""
    marked = len(changed)
    items = {key: copy(item) for key, item in value.items()}
    if type(value) is dict:
        return items
    originals = dict(value.items())
    try:
        rebuilt = _copy.copy(value)
        for key, item in items.items():
            rebuilt[key] = item
    except Exception:  # an immutable or unusual mapping: not rebuilt
        rebuilt = None
    if rebuilt is None or any(value[key] is not original for key, original in originals.items()):
        _put_back(value, originals)
        del changed[marked:]
        return value
    return rebuilt


def _put_back(value: Mapping, originals: dict) -> None:
    """Undo item assignments that reached ``value`` through a copy sharing its storage."""
    for key, original in originals.items():
        if value[key] is not original:
            value[key] = original  # type: ignore[index]
