"""Losses whose mean divides by a sum that moves with the batch's examples, seen while a check's pass runs.

Two such divisors hide in torch's ``reduction="mean"`` (its default, also inside ``nn.CrossEntropyLoss`` and
``nn.NLLLoss``):

- **class weights:** ``cross_entropy(z, y, weight=w)`` and ``nll_loss(z, y, weight=w)`` compute
  ``Σ_i w_{y_i} l_i / Σ_i w_{y_i}``;
- **ignored targets:** with targets equal to ``ignore_index`` (-100 by default: padding in a sequence model, an
  unlabelled example), the mean is over the targets not ignored, ``Σ_t l_t / n_B``, where ``n_B`` counts them in the
  batch. Where every example holds as many of them, ``n_B`` is a constant.

Either way the batch gradient is a ratio of two sums over the batch. Its noise changes with the batch size, and no
single ``B_simple`` describes it: on the digits MLP with class weights 0.1–10, ``B·tr Cov(G_B)/|E G_B|²`` is 16.1 at
batch 8 and 11.1 at batch 32, and per-example norms read 16.8–17.1 with intervals of ±6%; on a digits token model
whose examples hold 1 to 8 targets by class, 56.8 at batch 8 and 48.2 at 32, and per-example norms read 52.4–55.5
with intervals of ±7% (``benchmarks/batch_normalised_losses.py``). A divisor that does not depend on the batch
(``reduction="sum"`` divided by a constant) makes the terms independent again, and they are measured exactly.

A :class:`~torch.overrides.TorchFunctionMode` sees every call of the two functions, with their arguments; it only
looks, and returns what the call returns. Equal weights and equal counts per example are not reported. Torch only.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["WeightedMeanWatch", "weighted_mean_reason"]

_WATCHED: tuple[Callable[..., Any], ...] = (F.cross_entropy, F.nll_loss)
#: What the mean divides by, as the reason names it.
CLASS_WEIGHTS = "the batch's sum of class weights, Σ_i w[y_i]"
TARGETS_KEPT = "the batch's count of targets not equal to ignore_index"


class WeightedMeanWatch(TorchFunctionMode):
    """Records the first call of ``cross_entropy`` or ``nll_loss`` whose mean divides by a sum that moves with the
    batch (``found``: the function's name, or None; ``divides_by``: :data:`CLASS_WEIGHTS` or :data:`TARGETS_KEPT`).
    ``batch_size``, the pass's examples, tells how the targets fall into examples."""

    def __init__(self, batch_size: Optional[int] = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.found: Optional[str] = None
        self.divides_by: Optional[str] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None and func in _WATCHED:
            self.divides_by = _moving_divisor(inspect.signature(func).bind(*args, **kwargs).arguments,
                                              self.batch_size)
            self.found = func.__name__ if self.divides_by is not None else None
        return func(*args, **kwargs)


def _moving_divisor(bound: dict[str, Any], batch_size: Optional[int]) -> Optional[str]:
    """What the call's mean divides by, where that moves with the batch; None for a constant divisor: another
    reduction (the legacy ``size_average``/``reduce`` flags read as torch reads them), class probabilities as
    targets (``cross_entropy``'s mean then divides by the count of rows), or a call the backward pass can't reach
    (one for a logged metric)."""
    target, scores = bound.get("target"), bound.get("input")
    if not (isinstance(scores, torch.Tensor) and scores.requires_grad and torch.is_grad_enabled()):
        return None
    if not isinstance(target, torch.Tensor) or target.is_floating_point() or _reduction(bound) != "mean":
        return None
    if _unequal_weights(bound.get("weight")):
        return CLASS_WEIGHTS
    if _unequal_counts_kept(target, bound.get("ignore_index", -100), batch_size):
        return TARGETS_KEPT
    return None


def _reduction(bound: dict[str, Any]) -> str:
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        return torch.nn._reduction.legacy_get_string(bound.get("size_average"), bound.get("reduce"),
                                                     emit_warning=False)
    return bound.get("reduction", "mean")


def _unequal_weights(weight: Any) -> bool:
    if not isinstance(weight, torch.Tensor) or weight.numel() < 2:
        return False
    flat = weight.detach().reshape(-1)
    return bool((flat != flat[0]).any())


def _unequal_counts_kept(target: torch.Tensor, ignore_index: int, batch_size: Optional[int]) -> bool:
    """Some target ignored, and the examples keep unequal numbers of targets (``n_B`` then moves with them).
    Targets fall into examples along their first dim of the batch's size, or, flattened (``labels.view(-1)``), as
    ``batch_size`` runs of equal length; where neither shows, any ignored target counts."""
    kept = target.detach() != ignore_index
    if bool(kept.all()):
        return False
    per_example = _per_example(kept, batch_size)
    if per_example is None:
        return True
    counts = per_example.sum(1)
    return bool((counts != counts[0]).any())


def _per_example(kept: torch.Tensor, batch_size: Optional[int]) -> Optional[torch.Tensor]:
    """``kept`` as one row per example, or None where the batch's examples can't be told in it."""
    if not batch_size:
        return None
    if kept.dim() >= 2 and batch_size in kept.shape:
        return kept.movedim(list(kept.shape).index(batch_size), 0).reshape(batch_size, -1)
    if kept.dim() == 1 and kept.numel() % batch_size == 0:
        return kept.reshape(batch_size, -1)
    return None


def weighted_mean_reason(name: str, divides_by: str = CLASS_WEIGHTS) -> str:
    """Why no method measures the step, and the fix."""
    if divides_by == TARGETS_KEPT:
        return (f"the loss is a mean over the targets not ignored ({name}(...) with reduction='mean' and targets "
                f"equal to ignore_index, as padding, divides by {divides_by}, which differs between examples): the "
                "batch gradient is then a ratio of two sums over the batch, whose noise changes with the batch size, "
                "so no single noise scale describes it (per-example norms read it 1.1–2.1× too high on a digits "
                "token model, with narrow intervals). To measure it, divide by a constant instead: "
                f"{name}(..., reduction='sum') / (batch_size * c), with c the mean count of targets kept per example "
                "over the training set, which has the same expected gradient")
    return (f"the loss is a mean over the batch's own class weights ({name}(..., weight=w) with reduction='mean' "
            f"divides by {divides_by}): the batch gradient is then a ratio of two sums over "
            "the batch, whose noise changes with the batch size, so no single noise scale describes it (per-example "
            "norms read it 1.15–1.5× too high on the digits, with narrow intervals). To measure it, divide by a "
            f"constant instead: {name}(..., weight=w, reduction='sum') / (batch_size * c), with c = w[y].mean() over "
            "the training set, which has the same expected gradient")
