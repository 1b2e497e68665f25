"""Per-example squared gradient norms for ``nn.Linear``, plus the shared sequence kernel.

The weight gradient of a linear map is ``Σ_i a_iᵀ δ_i`` (``a``: layer input, ``δ``: gradient of the
backpropagated loss w.r.t. the layer output), so example ``i`` contributes ``G_i = a_iᵀ δ_i``.
``sequence_sq_norms`` computes ``|G_i|²_F`` for inputs with a sequence axis (exactly, or for long sequences
through wide layers as an unbiased sketch, :mod:`.sketch`) and is reused by the convolution layers after im2col.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from .launches import launch_cost_per_example
from .sketch import SKETCH_EXTRA_LAUNCHES, SKETCH_MARGIN, sketch_cost, sketched_sq_norms

__all__ = ["linear_part_sq_norms", "linear_sq_norms", "linear_summed_grads", "prefers_gram", "row_sq_norms",
           "sequence_norm_choice", "sequence_norm_cost", "sequence_norm_costs", "sequence_norm_method",
           "sequence_sq_norms"]


def upcast(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Cast floating tensors to a common dtype of at least float32 (float64 is kept).

    Squares of fp16/bf16 values overflow or lose precision, so every norm is computed in float32.
    """
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return tuple(tensor.to(dtype) for tensor in tensors)


def includes_param(module: nn.Module, name: str, param_names: Collection[str] | None) -> bool:
    """Whether the module's own parameter ``name`` exists, is trainable and was asked for."""
    if param_names is not None and name not in param_names:
        return False  # first: a parametrized weight is recomputed on each read
    if parametrize.is_parametrized(module, name):  # read under no_grad, the recomputed weight would not require grad
        return any(p.requires_grad for p in module.parametrizations[name].parameters())
    param = getattr(module, name, None)
    return isinstance(param, Tensor) and param.requires_grad


def sequence_norm_costs(seq_len: float, in_features: float, out_features: float) -> tuple[float, float]:
    """Multiply-adds per example of ``|G_i|²`` by the Gram form and by materialising ``G_i``, reductions included.

    The Gram form costs ``T²·(K+L)`` for the two Gram matrices plus ``T²`` for their elementwise product:
    ``T²·(K+L+1)``; materialising costs ``T·K·L`` plus ``K·L`` for the squared sum: ``(T+1)·K·L``.
    """
    gram = seq_len**2 * (in_features + out_features + 1)
    return gram, (seq_len + 1) * in_features * out_features


def prefers_gram(seq_len: int, in_features: int, out_features: int) -> bool:
    """Whether the Gram form is cheaper than materialising ``G_i`` for one example (:func:`sequence_norm_costs`)."""
    gram, materialise = sequence_norm_costs(seq_len, in_features, out_features)
    return gram < materialise


def sequence_norm_choice(seq_len: float, in_features: float, out_features: float,
                         launch_share: float = 0.0) -> tuple[str, float]:
    """The method for ``|Σ_t a_tᵀ δ_t|²`` and its multiply-adds per example: ``"gram"`` or ``"materialise"`` (exact,
    whichever is cheaper), or ``"sketch"`` (:mod:`.sketch`, unbiased) when that is at least
    :data:`~.sketch.SKETCH_MARGIN` times cheaper than both, its :data:`~.sketch.SKETCH_EXTRA_LAUNCHES` kernels
    counted at ``launch_share`` each (a launch's cost per example of the call, 0 on the CPU): long sequences
    through wide layers."""
    gram, materialise = sequence_norm_costs(seq_len, in_features, out_features)
    sketch = sketch_cost(seq_len, in_features, out_features)
    if SKETCH_MARGIN * sketch + SKETCH_EXTRA_LAUNCHES * launch_share < min(gram, materialise):
        return "sketch", sketch
    return ("gram", gram) if gram < materialise else ("materialise", materialise)


def sequence_norm_method(seq_len: float, in_features: float, out_features: float, launch_share: float = 0.0) -> str:
    """The method :func:`sequence_norm_choice` picks."""
    return sequence_norm_choice(seq_len, in_features, out_features, launch_share)[0]


def sequence_norm_cost(seq_len: float, in_features: float, out_features: float, launch_share: float = 0.0) -> float:
    """Multiply-adds per example of the method :func:`sequence_norm_choice` picks."""
    return sequence_norm_choice(seq_len, in_features, out_features, launch_share)[1]


def sequence_sq_norms(activations: Tensor, grad_outputs: Tensor) -> Tensor:
    """``|Σ_t a_{i,t}ᵀ δ_{i,t}|²_F`` for ``activations`` (N, T, K) and ``grad_outputs`` (N, T, L).

    The Gram form ``Σ_{t,t'} (a_t·a_t')(δ_t·δ_t')`` (Goodfellow 2015, "Efficient per-example gradient
    computations"; BackPACK ``batch_l2_grad``), the materialised ``G_i = a_iᵀ δ_i``, or, for long sequences through
    wide layers, an unbiased random-probe sketch (:func:`~.sketch.sketched_sq_norms`): whichever
    :func:`sequence_norm_method` picks for these shapes on this device. Returns shape (N,).
    """
    examples, seq_len, in_features = activations.shape
    method = sequence_norm_method(seq_len, in_features, grad_outputs.shape[-1],
                                  launch_cost_per_example(activations.device, examples))
    if method == "sketch":
        return sketched_sq_norms(activations, grad_outputs)
    if method == "gram":
        activation_gram = torch.bmm(activations, activations.transpose(1, 2))
        grad_gram = torch.bmm(grad_outputs, grad_outputs.transpose(1, 2))
        # Mathematically >= 0; rounding can make a near-zero result slightly negative. A product and a sum
        # is faster than einsum's batched dot on CPU (1.7 against 2.4 ms for (32, 64, 128) × (32, 64, 512)).
        return activation_gram.mul_(grad_gram).sum(dim=(1, 2)).clamp_min(0)
    per_example_grads = torch.bmm(activations.transpose(1, 2), grad_outputs)
    return per_example_grads.square_().sum(dim=(1, 2))


def linear_sq_norms(
    module: nn.Linear,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> Tensor:
    """Per-example squared gradient norm of an ``nn.Linear``'s trainable weight and bias.

    Input (B, K): ``|∇W_i|² = |a_i|²·|δ_i|²`` (Goodfellow 2015), bias ``|δ_i|²``.
    Input (B, *, K): the middle dims form a sequence, see :func:`sequence_sq_norms`; bias
    ``|Σ_t δ_{i,t}|²``.

    ``param_names`` restricts the parameters measured (default: all trainable ones). The result has
    shape (B,), dtype float32 (float64 for float64 inputs), and is for exactly the loss that was
    backpropagated (no rescaling).
    """
    if inp.dim() < 2:
        raise ValueError(f"Linear input needs a leading batch dimension, got shape {tuple(inp.shape)}")
    return linear_part_sq_norms(inp, grad_output, includes_param(module, "weight", param_names),
                                includes_param(module, "bias", param_names))


def linear_part_sq_norms(inp: Tensor, grad_output: Tensor, use_weight: bool, use_bias: bool) -> Tensor:
    """:func:`linear_sq_norms` of a linear map given by its input (B, *, K) and output gradient (B, *, L) alone:
    the weight's part if ``use_weight``, the bias's if ``use_bias``."""
    activations, grads = upcast(inp, grad_output)
    batch_size = activations.shape[0]
    if activations.dim() == 2:
        return _flat_sq_norms(activations, grads, use_weight, use_bias)
    total = activations.new_zeros(batch_size)
    activations = activations.reshape(batch_size, -1, activations.shape[-1])
    grads = grads.reshape(batch_size, -1, grads.shape[-1])
    if use_weight:
        total = total + sequence_sq_norms(activations, grads)
    if use_bias:
        total = total + grads.sum(dim=1).square().sum(dim=1)
    return total


def row_sq_norms(rows: Tensor) -> Tensor:
    """``|r_i|²`` for each row of ``rows`` (B, K): one fused reduction, no squared copy of ``rows`` (about 0.6× the
    time of ``rows.square().sum(1)`` on the CPU)."""
    return torch.linalg.vector_norm(rows, dim=1).square_()


def _flat_sq_norms(activations: Tensor, grads: Tensor, use_weight: bool, use_bias: bool) -> Tensor:
    """Inputs (B, K), output gradients (B, L): weight ``|a_i|²·|δ_i|²``, bias ``|δ_i|²``, together
    ``(|a_i|² + 1)·|δ_i|²``."""
    grad_sq = row_sq_norms(grads)
    if not use_weight:
        return grad_sq if use_bias else torch.zeros_like(grad_sq)
    activation_sq = row_sq_norms(activations)
    return (activation_sq.add_(1) if use_bias else activation_sq).mul_(grad_sq)


def linear_summed_grads(
    module: nn.Linear,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> dict[str, Tensor]:
    """The gradient these examples alone contribute, ``Σ_i G_i``: weight ``Σ_{i,t} δ_{i,t} a_{i,t}ᵀ`` (L, K), bias
    ``Σ_{i,t} δ_{i,t}``; the layer's own backward restricted to the rows given. Float32 (float64 kept)."""
    activations, grads = upcast(inp, grad_output)
    activations = activations.reshape(-1, activations.shape[-1])
    grads = grads.reshape(-1, grads.shape[-1])
    summed = {}
    if includes_param(module, "weight", param_names):
        summed["weight"] = grads.t() @ activations
    if includes_param(module, "bias", param_names):
        summed["bias"] = grads.sum(dim=0)
    return summed
