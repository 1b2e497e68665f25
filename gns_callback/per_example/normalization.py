"""Per-example squared gradient norms for ``nn.LayerNorm``, ``nn.GroupNorm`` and ``nn.RMSNorm``.

The affine parameters act elementwise on the normalised input ``x̂``: example ``i`` contributes
``Σ_positions x̂_i ⊙ δ_i`` to the weight gradient and ``Σ_positions δ_i`` to the bias gradient
(BackPACK ``batch_l2_grad``). ``x̂`` is recomputed from the saved input with the module's own eps.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import includes_param, upcast

__all__ = ["group_norm_sq_norms", "group_norm_summed_grads", "layer_norm_sq_norms", "layer_norm_summed_grads",
           "rms_norm_sq_norms", "rms_norm_summed_grads"]


def _elementwise_affine_sq_norms(
    normalized: Tensor | None, grads: Tensor, num_features: int, use_bias: bool, channels_first: bool
) -> Tensor:
    """``|Σ_pos x̂⊙δ|² + |Σ_pos δ|²`` per example (weight term only if ``normalized`` is given)."""
    batch_size = grads.shape[0]

    def summed_over_positions(values: Tensor) -> Tensor:
        if channels_first:  # (B, C, *positions)
            return values.reshape(batch_size, num_features, -1).sum(dim=2)
        return values.reshape(batch_size, -1, num_features).sum(dim=1)  # (B, *positions, *features)

    total = grads.new_zeros(batch_size)
    if normalized is not None:
        total = total + summed_over_positions(normalized.mul_(grads)).square().sum(dim=1)
    if use_bias:
        total = total + summed_over_positions(grads).square().sum(dim=1)
    return total


def _check_batched(module: nn.Module, inp: Tensor, normalized_ndim: int) -> None:
    if inp.dim() <= normalized_ndim:
        raise ValueError(
            f"{type(module).__name__} input needs a leading batch dimension before the normalised "
            f"dims, got shape {tuple(inp.shape)}"
        )


def layer_norm_sq_norms(
    module: nn.LayerNorm,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> Tensor:
    """Per-example squared gradient norm of an ``nn.LayerNorm``'s trainable weight and bias.

    Input (B, *positions, *normalized_shape): weight ``|Σ_pos x̂_i ⊙ δ_i|²``, bias ``|Σ_pos δ_i|²``
    (BackPACK ``batch_l2_grad``). Shape (B,), float32 (float64 for float64 inputs), for exactly the
    loss that was backpropagated. Works with ``bias=False``.
    """
    shape = tuple(module.normalized_shape)
    _check_batched(module, inp, len(shape))
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        normalized = F.layer_norm(inp, shape, None, None, module.eps)
    use_bias = includes_param(module, "bias", param_names)
    return _elementwise_affine_sq_norms(normalized, grads, math.prod(shape), use_bias, channels_first=False)


def rms_norm_sq_norms(
    module: nn.RMSNorm,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> Tensor:
    """Per-example squared gradient norm of an ``nn.RMSNorm`` weight: ``|Σ_pos x̂_i ⊙ δ_i|²``.

    ``eps=None`` means the machine epsilon of the *input* dtype, as in the module's forward.
    Shape (B,), float32 (float64 for float64 inputs).
    """
    shape = tuple(module.normalized_shape)
    _check_batched(module, inp, len(shape))
    eps = module.eps if module.eps is not None else torch.finfo(inp.dtype).eps
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        normalized = F.rms_norm(inp, shape, None, eps)
    return _elementwise_affine_sq_norms(normalized, grads, math.prod(shape), False, channels_first=False)


def group_norm_sq_norms(
    module: nn.GroupNorm,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> Tensor:
    """Per-example squared gradient norm of an ``nn.GroupNorm``'s trainable weight and bias.

    Input (B, C, *positions), per-channel parameters (C,): weight ``|Σ_pos x̂_i ⊙ δ_i|²``, bias
    ``|Σ_pos δ_i|²`` (BackPACK ``batch_l2_grad``). Shape (B,), float32 (float64 for float64 inputs).
    """
    _check_batched(module, inp, 1)
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        normalized = F.group_norm(inp, module.num_groups, None, None, module.eps)
    use_bias = includes_param(module, "bias", param_names)
    return _elementwise_affine_sq_norms(normalized, grads, module.num_channels, use_bias, channels_first=True)


def _elementwise_affine_summed(
    module: nn.Module, normalized: Tensor | None, grads: Tensor, use_bias: bool, channels_first: bool
) -> dict[str, Tensor]:
    """``Σ_{i,pos} x̂⊙δ`` (weight, only if ``normalized`` is given) and ``Σ_{i,pos} δ`` (bias), in the parameters'
    shapes: the gradient the given examples alone contribute."""
    shape = module.weight.shape if getattr(module, "weight", None) is not None else module.bias.shape

    def summed(values: Tensor) -> Tensor:
        if channels_first:  # (B, C, *positions)
            return values.transpose(0, 1).reshape(shape.numel(), -1).sum(dim=1).reshape(shape)
        return values.reshape(-1, shape.numel()).sum(dim=0).reshape(shape)

    out = {}
    if normalized is not None:
        out["weight"] = summed(normalized.mul_(grads))
    if use_bias:
        out["bias"] = summed(grads)
    return out


def layer_norm_summed_grads(
    module: nn.LayerNorm, inp: Tensor, grad_output: Tensor, *, param_names: Collection[str] | None = None
) -> dict[str, Tensor]:
    """Weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` and bias ``Σ_{i,pos} δ_i`` over the rows given (float32, float64 kept)."""
    shape = tuple(module.normalized_shape)
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        normalized = F.layer_norm(inp, shape, None, None, module.eps)
    return _elementwise_affine_summed(module, normalized, grads, includes_param(module, "bias", param_names), False)


def rms_norm_summed_grads(
    module: nn.RMSNorm, inp: Tensor, grad_output: Tensor, *, param_names: Collection[str] | None = None
) -> dict[str, Tensor]:
    """Weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` over the rows given (``eps=None``: the input dtype's epsilon)."""
    shape = tuple(module.normalized_shape)
    eps = module.eps if module.eps is not None else torch.finfo(inp.dtype).eps
    inp, grads = upcast(inp, grad_output)
    if not includes_param(module, "weight", param_names):
        return {}
    return _elementwise_affine_summed(module, F.rms_norm(inp, shape, None, eps), grads, False, False)


def group_norm_summed_grads(
    module: nn.GroupNorm, inp: Tensor, grad_output: Tensor, *, param_names: Collection[str] | None = None
) -> dict[str, Tensor]:
    """Per-channel weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` and bias ``Σ_{i,pos} δ_i`` over the rows given."""
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        normalized = F.group_norm(inp, module.num_groups, None, None, module.eps)
    return _elementwise_affine_summed(module, normalized, grads, includes_param(module, "bias", param_names), True)
