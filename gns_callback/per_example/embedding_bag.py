"""Per-example squared gradient norms for ``nn.EmbeddingBag`` (``mode="sum"`` or ``"mean"``), one example per bag.

Bag ``b``'s output is ``Σ_{t∈b} w_t·W[x_t]`` with ``w_t = 1`` (sum), the ``per_sample_weights`` (sum), or ``1/n_b``
(mean, ``n_b`` the bag's tokens other than ``padding_idx``); ``padding_idx`` tokens count for nothing. So the bag's
weight gradient puts ``c_{b,r}·δ_b`` in row ``r``, with ``c_{b,r} = Σ_{t∈b, x_t=r} w_t``, and

    |∇W_b|² = |δ_b|² · Σ_r c_{b,r}²

(the embedding's rule, :mod:`.embedding`, with one output gradient per bag). The coefficients are summed per
``(bag, token)`` pair after one sort, with no device sync. Bags are given as a ``(B, L)`` input or as a flat input
with ``offsets`` (``include_last_offset`` either way). ``mode="max"`` (the gradient goes to each dimension's
largest entry) and the options :func:`~.embedding.embedding_unsupported_reason` names are left out, with the reason.
Checked against per-bag backward passes in ``tests/per_example/test_embedding_bag.py``. Torch only.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from .embedding import embedding_unsupported_reason
from .linear import upcast

__all__ = ["bag_inputs", "embedding_bag_sq_norms", "embedding_bag_unsupported_reason"]


def embedding_bag_unsupported_reason(module: nn.EmbeddingBag) -> Optional[str]:
    """Why this bag embedding's per-example norms can't be computed, or None if they can."""
    if module.mode == "max":
        return "nn.EmbeddingBag with mode='max' sends each dimension's gradient to one token of the bag"
    return embedding_unsupported_reason(module)  # type: ignore[arg-type]  (max_norm, sparse, scale_grad_by_freq)


def bag_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``(input, offsets, per_sample_weights)`` of an ``nn.EmbeddingBag`` forward call."""
    names = ("input", "offsets", "per_sample_weights")
    values = list(args[:3]) + [None] * (3 - len(args[:3]))
    return tuple(kwargs.get(name, value) for name, value in zip(names, values))  # type: ignore[return-value]


def _bag_of_each_token(module: nn.EmbeddingBag, tokens: Tensor, offsets: Optional[Tensor]) -> tuple[Tensor, int]:
    """The flat tokens' bag indices and the number of bags."""
    if tokens.dim() == 2:
        bags, length = tokens.shape
        return torch.arange(bags, device=tokens.device).repeat_interleave(length), bags
    starts = offsets[:-1] if module.include_last_offset else offsets
    positions = torch.arange(tokens.numel(), device=tokens.device)
    return torch.searchsorted(starts, positions, right=True) - 1, starts.numel()


def _token_weights(module: nn.EmbeddingBag, flat: Tensor, bag: Tensor, bags: int, weights: Optional[Tensor],
                   dtype: torch.dtype) -> Tensor:
    """``w_t`` of every flat token (module docstring): 0 for ``padding_idx``."""
    w = torch.ones(flat.shape, dtype=dtype, device=flat.device) if weights is None else weights.reshape(-1).to(dtype)
    if module.padding_idx is not None:
        w = w.masked_fill(flat == module.padding_idx, 0.0)
    if module.mode == "mean":
        counts = torch.zeros(bags, dtype=dtype, device=flat.device).index_add_(0, bag, (w != 0).to(dtype))
        w = w / counts.clamp_min(1.0)[bag]
    return w


def embedding_bag_sq_norms(module: nn.EmbeddingBag, tokens: Tensor, offsets: Optional[Tensor],
                           per_sample_weights: Optional[Tensor], grad_output: Tensor) -> Tensor:
    """``|∇W_b|²`` per bag ``(B,)`` (module docstring), float32 (float64 kept)."""
    (grads,) = upcast(grad_output)
    flat = tokens.reshape(-1)
    bag, bags = _bag_of_each_token(module, tokens, offsets)
    weights = _token_weights(module, flat, bag, bags, per_sample_weights, grads.dtype)
    keys = bag * module.num_embeddings + flat
    keys, order = keys.sort()
    new = torch.ones_like(keys, dtype=torch.bool)
    new[1:] = keys[1:] != keys[:-1]
    pair = new.cumsum(0) - 1  # (bag, token) pair of each sorted token
    coefficients = torch.zeros_like(weights).index_add_(0, pair, weights[order])
    pair_bag = torch.zeros_like(bag).index_copy_(0, pair, bag[order])
    squares = torch.zeros(bags, dtype=grads.dtype, device=grads.device).index_add_(0, pair_bag, coefficients.square())
    return squares * grads.square().sum(-1)
