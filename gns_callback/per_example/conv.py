"""Per-example squared gradient norms for ``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` via im2col.

After unfolding, a convolution is a linear map applied at every output position, so example ``i``
contributes ``Σ_p u_{i,p}ᵀ δ_{i,p}`` per group (Rochette et al. 2019, "Efficient per-example gradient
computations in convolutional neural networks"; BackPACK ``batch_l2_grad``).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .launches import launch_cost_per_example
from .linear import includes_param, sequence_norm_method, sequence_sq_norms, upcast
from .sketch import PROBES, probe_signs

__all__ = ["ConvNd", "conv_summed_grads", "conv_sq_norms", "conv_weight_sq_norms", "im2col_weight_sq_norms",
           "per_example_weight_grads", "spatial_dims", "unfold_input"]

ConvNd = Union[nn.Conv1d, nn.Conv2d, nn.Conv3d]

#: Each convolution's weight-gradient function, by its number of spatial dims.
_WEIGHT_GRADS = {1: torch.nn.grad.conv1d_weight, 2: torch.nn.grad.conv2d_weight, 3: torch.nn.grad.conv3d_weight}


def spatial_dims(module: nn.Module) -> int:
    """1, 2 or 3: a convolution's or transposed convolution's spatial dims (not read off a weight that may be
    computed on each read, as a weight-normalised one is)."""
    return len(module.kernel_size)


def unfold_input(module: ConvNd, inp: Tensor) -> Tensor:
    """im2col of ``inp`` as the module sees it: (B, C_in·kernel_numel, output_positions).

    Padding is applied explicitly with the module's own (possibly asymmetric, for ``'same'``) amounts
    and mode, exactly like ``_ConvNd`` does for non-zero padding modes.
    """
    padding = module._reversed_padding_repeated_twice
    if any(padding):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        inp = F.pad(inp, padding, mode=mode)
    return _im2col(inp, module.kernel_size, module.dilation, module.stride)


def _im2col(inp: Tensor, kernel_size: tuple, dilation: tuple, stride: tuple) -> Tensor:
    """``F.unfold(inp, kernel_size, dilation, padding=0, stride)`` as a strided view plus one copy, for any number
    of spatial dims (``F.unfold`` takes two).

    The view ``(B, C, *kernel, *out)`` over the (already padded) input, reshaped, is exactly ``F.unfold``'s
    ``(B, C·kernel_numel, out_positions)`` in 2-D, about 3× faster on CPU (Opacus ``unfold2d`` does the same).
    """
    batch, channels, *extent = inp.shape
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, d, s in zip(extent, kernel_size, dilation, stride)]
    s_b, s_c, *steps = inp.stride()
    windows = inp.as_strided((batch, channels, *kernel_size, *out),
                             (s_b, s_c, *(a * d for a, d in zip(steps, dilation)),
                              *(a * s for a, s in zip(steps, stride))))
    return windows.reshape(batch, channels * math.prod(kernel_size), math.prod(out))


def conv_sq_norms(
    module: ConvNd,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> Tensor:
    """Per-example squared gradient norm of a ``Conv1d``/``Conv2d``/``Conv3d``'s trainable weight and bias.

    Weight: ``Σ_g |Σ_p u_{i,g,p}ᵀ δ_{i,g,p}|²`` over groups ``g`` and output positions ``p`` with the
    unfolded input ``u`` (Rochette et al. 2019): materialised by :func:`per_example_weight_grads`, from im2col
    (:func:`sequence_sq_norms`), or as an unbiased sketch where that is much cheaper (:mod:`.sketch`), as
    :func:`conv_weight_sq_norms` picks. Bias: ``|Σ_p δ_{i,p}|²``.
    Shape (B,), float32 (float64 for float64 inputs), for exactly the loss that was backpropagated.
    """
    if not isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        raise TypeError(f"expected nn.Conv1d, nn.Conv2d or nn.Conv3d, got {type(module).__name__}")
    if inp.dim() != spatial_dims(module) + 2:
        raise ValueError(
            f"{type(module).__name__} input needs a leading batch dimension, got shape {tuple(inp.shape)}"
        )
    inp, grad_output = upcast(inp, grad_output)
    batch_size = inp.shape[0]
    total = inp.new_zeros(batch_size)
    if includes_param(module, "weight", param_names):
        total = total + conv_weight_sq_norms(module, inp, grad_output)
    if includes_param(module, "bias", param_names):
        total = total + grad_output.reshape(batch_size, module.out_channels, -1).sum(dim=-1).square().sum(dim=1)
    return total


#: Below this many input channels per group, im2col + ``bmm`` beats the grouped weight-gradient convolution on
#: CPU (which vectorises over input channels): 3.1 against 4.1 ms for a 3→32 3×3 layer on a (64, 3, 32, 32) batch;
#: with 16–128 channels the convolution was 1.05–1.7× faster. Measured, see benchmarks/RESULTS.md "Overhead".
_GROUPED_CONV_MIN_CHANNELS = 8


def conv_weight_sq_norms(module: ConvNd, inp: Tensor, grad_output: Tensor) -> Tensor:
    """``Σ_g |∇W_{i,g}|²`` per example, by the method :func:`~.linear.sequence_norm_method` picks for one group's
    ``positions × (in·kernel) × out`` shape: materialised by one grouped convolution
    (:func:`per_example_weight_grads`), or sketched by one with ``PROBES`` output channels
    (:func:`_sketched_weight_sq_norms`); the Gram form, and layers with few input channels, go through im2col."""
    batch_size, groups = inp.shape[0], module.groups
    out_per_group = module.out_channels // groups
    positions = grad_output[0, 0].numel()
    method = sequence_norm_method(positions, module.weight[0].numel(), out_per_group,
                                  launch_cost_per_example(inp.device, batch_size * groups))
    if module.in_channels // groups >= _GROUPED_CONV_MIN_CHANNELS and method != "gram":
        if method == "sketch":
            return _sketched_weight_sq_norms(module, inp, grad_output)
        grads = per_example_weight_grads(module, inp, grad_output)
        return grads.reshape(batch_size, -1).square_().sum(dim=1)  # in place: no second (B·out, in, *kernel) buffer
    return im2col_weight_sq_norms(module, inp, grad_output)


def im2col_weight_sq_norms(module: ConvNd, inp: Tensor, grad_output: Tensor) -> Tensor:
    """``Σ_g |∇W_{i,g}|²`` per example from the unfolded input: each group's ``Σ_p u_pᵀ δ_p`` by
    :func:`~.linear.sequence_sq_norms` (Gram, materialised or sketched, as it picks for the shape)."""
    batch_size, groups = inp.shape[0], module.groups
    positions = grad_output[0, 0].numel()
    columns = unfold_input(module, inp)  # channel-major, so each group is a contiguous block
    columns = columns.reshape(batch_size * groups, -1, positions).transpose(1, 2)
    group_grads = grad_output.reshape(batch_size * groups, module.out_channels // groups, positions).transpose(1, 2)
    return sequence_sq_norms(columns, group_grads).reshape(batch_size, groups).sum(dim=1)


def _sketched_weight_sq_norms(module: ConvNd, inp: Tensor, grad_output: Tensor) -> Tensor:
    """Unbiased sketch of ``Σ_g |∇W_{i,g}|²`` (:mod:`.sketch`): per example and group, ``k = PROBES`` Rademacher
    combinations of the output channels, ``δ·s``, are a ``k``-channel output gradient whose weight gradient is
    ``∇W_{i,g}·s``; one grouped convolution gives them all, ``(1/k)·Σ_j |∇W_{i,g}·s_j|²``."""
    batch_size, groups = inp.shape[0], module.groups
    spatial = grad_output.shape[2:]
    grads = grad_output.reshape(batch_size, groups, module.out_channels // groups, -1)
    signs = probe_signs((batch_size, groups, grads.shape[2], PROBES), grads.device, grads.dtype)
    projected = torch.matmul(signs.transpose(2, 3), grads).reshape(batch_size, groups * PROBES, *spatial)
    sketches = per_example_weight_grads(module, inp, projected, out_channels=groups * PROBES)
    return sketches.reshape(batch_size, -1).square_().sum(dim=1).div_(PROBES)


def per_example_weight_grads(module: ConvNd, inp: Tensor, grad_output: Tensor,
                             out_channels: int | None = None) -> Tensor:
    """Per-example weight gradients (B·out_channels, in_channels/groups, *kernel) of ``module``.

    One weight-gradient convolution with the batch folded into the channels and ``B·groups`` groups (the
    grouped-convolution formulation discussed by Rochette et al. 2019): each example is its own group, so group
    ``(i, g)`` yields ``Σ_p u_{i,g,p}ᵀ δ_{i,g,p}``. No im2col copy; on CPU 1.05–1.7× faster than unfold + ``bmm``
    from 16 input channels per group up (see ``_GROUPED_CONV_MIN_CHANNELS``). ``out_channels``: of
    ``grad_output``, when it is not the module's own (a sketch's projected gradient).
    """
    inp, padding = _padded(module, inp)
    kernel_size, dilation, stride = module.kernel_size, module.dilation, module.stride
    if isinstance(module, nn.Conv1d):  # a 2-D convolution of height 1
        inp, grad_output = inp.unsqueeze(2), grad_output.unsqueeze(2)
        kernel_size, dilation, stride, padding = (1, *kernel_size), (1, *dilation), (1, *stride), (0, *padding)
    batch_size, groups = inp.shape[0], module.groups
    out_channels = module.out_channels if out_channels is None else out_channels
    weight_shape = (batch_size * out_channels, module.in_channels // groups, *kernel_size)
    return _WEIGHT_GRADS[len(kernel_size)](
        inp.reshape(1, -1, *inp.shape[2:]), weight_shape, grad_output.reshape(1, -1, *grad_output.shape[2:]),
        stride=stride, padding=padding, dilation=dilation, groups=batch_size * groups,
    )


def _padded(module: ConvNd, inp: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """``inp`` and the padding left for the convolution: symmetric zero padding is left to it (no copy); any
    other (``'same'``'s possibly asymmetric amounts, non-zero modes) is applied here, as ``_ConvNd`` does."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return inp, tuple(module.padding)
    padding = module._reversed_padding_repeated_twice
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    return (F.pad(inp, padding, mode=mode) if any(padding) else inp), (0,) * spatial_dims(module)


def conv_summed_grads(
    module: ConvNd,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> dict[str, Tensor]:
    """The gradient these examples alone contribute: the layer's weight-gradient convolution and bias sum over the
    rows given (same padding, stride, dilation and groups as its forward). Float32 (float64 kept)."""
    inp, grad_output = upcast(inp, grad_output)
    summed = {}
    if includes_param(module, "weight", param_names):
        padded, padding = _padded(module, inp)
        summed["weight"] = _WEIGHT_GRADS[spatial_dims(module)](padded, module.weight.shape, grad_output,
                                                               stride=module.stride, padding=padding,
                                                               dilation=module.dilation, groups=module.groups)
    if includes_param(module, "bias", param_names):
        summed["bias"] = grad_output.transpose(0, 1).reshape(module.out_channels, -1).sum(dim=1)
    return summed
