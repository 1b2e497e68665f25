"""Losses averaged over the batch's own class weights, seen while a check's pass runs.

``cross_entropy(z, y, weight=w)`` and ``nll_loss(z, y, weight=w)`` with ``reduction="mean"`` (torch's default, also
inside ``nn.CrossEntropyLoss(weight=w)`` and ``nn.NLLLoss(weight=w)``) compute ``Σ_i w_{y_i} l_i / Σ_i w_{y_i}``: the
divisor is a sum over the batch that moves with its examples, so the batch gradient is a ratio of two sums. Its noise
changes with the batch size, and no single ``B_simple`` describes it: on the digits MLP with class weights 0.1–10,
``B·tr Cov(G_B)/|E G_B|²`` is 16.1 at batch 8 and 11.1 at batch 32, and per-example norms read 16.8–17.1 with
intervals of ±6% (``benchmarks/batch_normalised_losses.py``). A divisor that does not depend on the batch
(``reduction="sum"`` divided by a constant) makes the terms independent again, and they are measured exactly.

A :class:`~torch.overrides.TorchFunctionMode` sees every call of the two functions, with their arguments; it only
looks, and returns what the call returns. Equal weights (a constant divisor) are not reported. Torch only.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["WeightedMeanWatch", "weighted_mean_reason"]

_WATCHED: tuple[Callable[..., Any], ...] = (F.cross_entropy, F.nll_loss)


class WeightedMeanWatch(TorchFunctionMode):
    """Records the first call of ``cross_entropy`` or ``nll_loss`` that divides by the batch's sum of class weights
    (``found``: the function's name, or None)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: Optional[str] = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None and func in _WATCHED and _divides_by_batch_weights(func, args, kwargs):
            self.found = func.__name__
        return func(*args, **kwargs)


def _divides_by_batch_weights(func: Callable[..., Any], args: tuple, kwargs: dict) -> bool:
    """``weight`` given, not all equal, and the mean reduction (the legacy ``size_average``/``reduce`` flags read as
    torch reads them), on class-index targets (with class probabilities as targets, ``cross_entropy``'s mean divides
    by the count of rows instead, a constant), in a call the backward pass can reach (not one for a logged metric)."""
    bound = inspect.signature(func).bind(*args, **kwargs).arguments
    weight, target, scores = bound.get("weight"), bound.get("target"), bound.get("input")
    if not isinstance(weight, torch.Tensor) or weight.numel() < 2:
        return False
    if not (isinstance(scores, torch.Tensor) and scores.requires_grad and torch.is_grad_enabled()):
        return False
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        return False
    reduction = bound.get("reduction", "mean")
    if bound.get("size_average") is not None or bound.get("reduce") is not None:
        reduction = torch.nn._reduction.legacy_get_string(bound.get("size_average"), bound.get("reduce"),
                                                          emit_warning=False)
    flat = weight.detach().reshape(-1)
    return reduction == "mean" and bool((flat != flat[0]).any())


def weighted_mean_reason(name: str) -> str:
    """Why no method measures the step, and the fix."""
    return (f"the loss is a mean over the batch's own class weights ({name}(..., weight=w) with reduction='mean' "
            "divides by the batch's sum of weights, Σ_i w[y_i]): the batch gradient is then a ratio of two sums over "
            "the batch, whose noise changes with the batch size, so no single noise scale describes it (per-example "
            "norms read it 1.15–1.5× too high on the digits, with narrow intervals). To measure it, divide by a "
            f"constant instead: {name}(..., weight=w, reduction='sum') / (batch_size * c), with c = w[y].mean() over "
            "the training set, which has the same expected gradient")
