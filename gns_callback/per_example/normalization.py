"""Per-example squared gradient norms for ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm``, the affine
``nn.InstanceNorm1d/2d/3d`` (nnU-Net's, style transfer's) and ``nn.BatchNorm1d/2d/3d`` in eval mode (frozen
statistics, as when fine-tuning; in training mode a BatchNorm couples the examples and is refused elsewhere).

The affine parameters act elementwise on the normalised input ``x̂``: example ``i`` contributes
``Σ_positions x̂_i ⊙ δ_i`` to the weight gradient and ``Σ_positions δ_i`` to the bias gradient
(BackPACK ``batch_l2_grad``). ``x̂`` is recomputed from the saved input with the module's own eps. Both the
per-example norms and a set of examples' summed gradient are read off these per-example contributions.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import includes_param, upcast

__all__ = ["BATCH_NORMS", "INSTANCE_NORMS", "batch_norm_sq_norms", "batch_norm_summed_grads", "group_norm_sq_norms",
           "group_norm_summed_grads", "instance_norm_sq_norms", "instance_norm_summed_grads", "layer_norm_sq_norms", "layer_norm_summed_grads", "rms_norm_sq_norms",
           "rms_norm_summed_grads"]


#: The instance norms measured (their affine parameters; without ``affine`` they have none).
INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
#: The batch norms measured, in eval mode with running statistics (their affine parameters).
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


@dataclass(frozen=True)
class _AffineTerms:
    """What an elementwise-affine layer's per-example gradients are made of: ``x̂`` (None when the weight is not
    measured) and ``δ``, upcast; ``num_features`` per-position parameters, channels in dim 1 or last."""

    normalized: Tensor | None
    grads: Tensor
    num_features: int
    use_bias: bool
    channels_first: bool

    def per_example(self, values: Tensor) -> Tensor:
        """``Σ_positions`` of ``values`` per example and feature: (B, num_features)."""
        batch_size = values.shape[0]
        if self.channels_first:  # (B, C, *positions)
            return values.reshape(batch_size, self.num_features, -1).sum(dim=2)
        return values.reshape(batch_size, -1, self.num_features).sum(dim=1)  # (B, *positions, *features)

    def contributions(self) -> dict[str, Tensor]:
        """Each measured parameter's per-example gradient, flattened: (B, num_features)."""
        out = {}
        if self.normalized is not None:
            out["weight"] = self.per_example(self.normalized.mul_(self.grads))
        if self.use_bias:
            out["bias"] = self.per_example(self.grads)
        return out


def _sq_norms(terms: _AffineTerms) -> Tensor:
    """``|Σ_pos x̂⊙δ|² + |Σ_pos δ|²`` per example (weight term only if ``x̂`` is given)."""
    total = terms.grads.new_zeros(terms.grads.shape[0])
    for grads in terms.contributions().values():
        total = total + grads.square().sum(dim=1)
    return total


def _summed(module: nn.Module, terms: _AffineTerms) -> dict[str, Tensor]:
    """``Σ_{i,pos} x̂⊙δ`` and ``Σ_{i,pos} δ`` in the parameters' shapes: the gradient these examples contribute."""
    return {name: grads.sum(dim=0).reshape(getattr(module, name).shape)
            for name, grads in terms.contributions().items()}


def _check_batched(module: nn.Module, inp: Tensor, normalized_ndim: int) -> None:
    if inp.dim() <= normalized_ndim:
        raise ValueError(
            f"{type(module).__name__} input needs a leading batch dimension before the normalised "
            f"dims, got shape {tuple(inp.shape)}"
        )


def _layer_norm_terms(module: nn.LayerNorm, inp: Tensor, grad_output: Tensor,
                      param_names: Collection[str] | None) -> _AffineTerms:
    shape = tuple(module.normalized_shape)
    _check_batched(module, inp, len(shape))
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        # A weight of ones gives the same x̂ to the bit, by a kernel about 1.6× faster on the CPU than without one.
        normalized = F.layer_norm(inp, shape, inp.new_ones(shape), None, module.eps)
    return _AffineTerms(normalized, grads, math.prod(shape), includes_param(module, "bias", param_names), False)


def _rms_norm_terms(module: nn.RMSNorm, inp: Tensor, grad_output: Tensor,
                    param_names: Collection[str] | None) -> _AffineTerms:
    shape = tuple(module.normalized_shape)
    _check_batched(module, inp, len(shape))
    eps = module.eps if module.eps is not None else torch.finfo(inp.dtype).eps
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        normalized = F.rms_norm(inp, shape, None, eps)
    return _AffineTerms(normalized, grads, math.prod(shape), False, False)


def _group_norm_terms(module: nn.GroupNorm, inp: Tensor, grad_output: Tensor,
                      param_names: Collection[str] | None) -> _AffineTerms:
    _check_batched(module, inp, 1)
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        normalized = F.group_norm(inp, module.num_groups, None, None, module.eps)
    return _AffineTerms(normalized, grads, module.num_channels, includes_param(module, "bias", param_names), True)


def _instance_norm_terms(module: nn.modules.instancenorm._InstanceNorm, inp: Tensor, grad_output: Tensor,
                         param_names: Collection[str] | None) -> _AffineTerms:
    """``x̂`` as the module's forward makes it: each example's own statistics per channel, or its running ones in
    eval mode where it tracks them (never updating them here)."""
    _check_batched(module, inp, module._get_no_batch_dim())
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        if module.training or not module.track_running_stats:
            normalized = F.instance_norm(inp, eps=module.eps)
        else:
            normalized = F.instance_norm(inp, module.running_mean, module.running_var, use_input_stats=False,
                                         eps=module.eps)
    return _AffineTerms(normalized, grads, module.num_features, includes_param(module, "bias", param_names), True)


def instance_norm_sq_norms(module: nn.Module, inp: Tensor, grad_output: Tensor, *,
                           param_names: Collection[str] | None = None) -> Tensor:
    """Per-example squared gradient norm of an affine ``nn.InstanceNorm1d/2d/3d``: weight ``|Σ_pos x̂_i ⊙ δ_i|²``,
    bias ``|Σ_pos δ_i|²``, per channel, as a GroupNorm with one channel per group."""
    return _sq_norms(_instance_norm_terms(module, inp, grad_output, param_names))


def instance_norm_summed_grads(module: nn.Module, inp: Tensor, grad_output: Tensor, *,
                               param_names: Collection[str] | None = None) -> dict[str, Tensor]:
    """Per-channel weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` and bias ``Σ_{i,pos} δ_i`` over the rows given."""
    return _summed(module, _instance_norm_terms(module, inp, grad_output, param_names))


def _batch_norm_terms(module: nn.modules.batchnorm._BatchNorm, inp: Tensor, grad_output: Tensor,
                      param_names: Collection[str] | None) -> _AffineTerms:
    """``x̂ = (x - running_mean) / sqrt(running_var + eps)`` per channel, as the module's eval-mode forward makes it.
    In training mode ``x̂`` is the batch's, as its forward made it, and these are not the examples' gradients (the
    batch statistics couple them): the meter refuses such a step on its own (``has_batchnorm_in_training``)."""
    _check_batched(module, inp, 1)
    inp, grads = upcast(inp, grad_output)
    normalized = None
    if includes_param(module, "weight", param_names):
        frozen = not module.training and module.track_running_stats
        mean, var = (module.running_mean, module.running_var) if frozen else (None, None)
        normalized = F.batch_norm(inp, mean, var, training=not frozen, eps=module.eps)
    return _AffineTerms(normalized, grads, module.num_features, includes_param(module, "bias", param_names), True)


def batch_norm_sq_norms(module: nn.Module, inp: Tensor, grad_output: Tensor, *,
                        param_names: Collection[str] | None = None) -> Tensor:
    """Per-example squared gradient norm of a ``nn.BatchNorm1d/2d/3d`` in eval mode: weight ``|Σ_pos x̂_i ⊙ δ_i|²``,
    bias ``|Σ_pos δ_i|²``, per channel (an elementwise affine map of ``x̂``, which its frozen statistics make each
    example's own)."""
    return _sq_norms(_batch_norm_terms(module, inp, grad_output, param_names))


def batch_norm_summed_grads(module: nn.Module, inp: Tensor, grad_output: Tensor, *,
                            param_names: Collection[str] | None = None) -> dict[str, Tensor]:
    """Per-channel weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` and bias ``Σ_{i,pos} δ_i`` over the rows given."""
    return _summed(module, _batch_norm_terms(module, inp, grad_output, param_names))


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
    return _sq_norms(_layer_norm_terms(module, inp, grad_output, param_names))


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
    return _sq_norms(_rms_norm_terms(module, inp, grad_output, param_names))


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
    return _sq_norms(_group_norm_terms(module, inp, grad_output, param_names))


def layer_norm_summed_grads(
    module: nn.LayerNorm, inp: Tensor, grad_output: Tensor, *, param_names: Collection[str] | None = None
) -> dict[str, Tensor]:
    """Weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` and bias ``Σ_{i,pos} δ_i`` over the rows given (float32, float64 kept)."""
    return _summed(module, _layer_norm_terms(module, inp, grad_output, param_names))


def rms_norm_summed_grads(
    module: nn.RMSNorm, inp: Tensor, grad_output: Tensor, *, param_names: Collection[str] | None = None
) -> dict[str, Tensor]:
    """Weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` over the rows given (``eps=None``: the input dtype's epsilon)."""
    return _summed(module, _rms_norm_terms(module, inp, grad_output, param_names))


def group_norm_summed_grads(
    module: nn.GroupNorm, inp: Tensor, grad_output: Tensor, *, param_names: Collection[str] | None = None
) -> dict[str, Tensor]:
    """Per-channel weight ``Σ_{i,pos} x̂_i ⊙ δ_i`` and bias ``Σ_{i,pos} δ_i`` over the rows given."""
    return _summed(module, _group_norm_terms(module, inp, grad_output, param_names))
