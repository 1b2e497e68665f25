"""Per-example squared gradient norms for ``nn.Conv1d`` / ``nn.Conv2d`` via im2col.

After unfolding, a convolution is a linear map applied at every output position, so example ``i``
contributes ``Σ_p u_{i,p}ᵀ δ_{i,p}`` per group (Rochette et al. 2019, "Efficient per-example gradient
computations in convolutional neural networks"; BackPACK ``batch_l2_grad``).
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import includes_param, sequence_norm_method, sequence_sq_norms, upcast
from .sketch import PROBES, probe_signs

__all__ = ["conv_summed_grads", "conv_sq_norms", "conv_weight_sq_norms", "per_example_weight_grads", "unfold_input"]


def unfold_input(module: nn.Conv1d | nn.Conv2d, inp: Tensor) -> Tensor:
    """im2col of ``inp`` as the module sees it: (B, C_in·kernel_numel, output_positions).

    Padding is applied explicitly with the module's own (possibly asymmetric, for ``'same'``) amounts
    and mode, exactly like ``_ConvNd`` does for non-zero padding modes.
    """
    padding = module._reversed_padding_repeated_twice
    if any(padding):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        inp = F.pad(inp, padding, mode=mode)
    kernel_size, dilation, stride = module.kernel_size, module.dilation, module.stride
    if isinstance(module, nn.Conv1d):
        inp = inp.unsqueeze(2)  # (B, C, 1, L): a 2-D convolution of height 1
        kernel_size, dilation, stride = (1, *kernel_size), (1, *dilation), (1, *stride)
    return _im2col(inp, kernel_size, dilation, stride)


def _im2col(inp: Tensor, kernel_size: tuple, dilation: tuple, stride: tuple) -> Tensor:
    """``F.unfold(inp, kernel_size, dilation, padding=0, stride)`` as a strided view plus one copy.

    The view ``(B, C, kh, kw, H_out, W_out)`` over the (already padded) input, reshaped, is exactly
    ``F.unfold``'s ``(B, C·kh·kw, H_out·W_out)``, about 3× faster on CPU (Opacus ``unfold2d`` does the same).
    """
    batch, channels, height, width = inp.shape
    (kh, kw), (dh, dw), (sh, sw) = kernel_size, dilation, stride
    out_h = (height - dh * (kh - 1) - 1) // sh + 1
    out_w = (width - dw * (kw - 1) - 1) // sw + 1
    s_b, s_c, s_h, s_w = inp.stride()
    windows = inp.as_strided(
        (batch, channels, kh, kw, out_h, out_w), (s_b, s_c, s_h * dh, s_w * dw, s_h * sh, s_w * sw)
    )
    return windows.reshape(batch, channels * kh * kw, out_h * out_w)


def conv_sq_norms(
    module: nn.Conv1d | nn.Conv2d,
    inp: Tensor,
    grad_output: Tensor,
    *,
    param_names: Collection[str] | None = None,
) -> Tensor:
    """Per-example squared gradient norm of a ``Conv1d``/``Conv2d``'s trainable weight and bias.

    Weight: ``Σ_g |Σ_p u_{i,g,p}ᵀ δ_{i,g,p}|²`` over groups ``g`` and output positions ``p`` with the
    unfolded input ``u`` (Rochette et al. 2019): materialised by :func:`per_example_weight_grads`, from im2col
    (:func:`sequence_sq_norms`), or as an unbiased sketch where that is much cheaper (:mod:`.sketch`), as
    :func:`conv_weight_sq_norms` picks. Bias: ``|Σ_p δ_{i,p}|²``.
    Shape (B,), float32 (float64 for float64 inputs), for exactly the loss that was backpropagated.
    """
    if not isinstance(module, (nn.Conv1d, nn.Conv2d)):
        raise TypeError(f"expected nn.Conv1d or nn.Conv2d, got {type(module).__name__}")
    spatial_dims = 1 if isinstance(module, nn.Conv1d) else 2
    if inp.dim() != spatial_dims + 2:
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


def conv_weight_sq_norms(module: nn.Conv1d | nn.Conv2d, inp: Tensor, grad_output: Tensor) -> Tensor:
    """``Σ_g |∇W_{i,g}|²`` per example, by the method :func:`~.linear.sequence_norm_method` picks for one group's
    ``positions × (in·kernel) × out`` shape: materialised by one grouped convolution
    (:func:`per_example_weight_grads`), or sketched by one with ``PROBES`` output channels
    (:func:`_sketched_weight_sq_norms`); the Gram form, and layers with few input channels, go through im2col."""
    batch_size, groups = inp.shape[0], module.groups
    out_per_group = module.out_channels // groups
    positions = grad_output[0, 0].numel()
    method = sequence_norm_method(positions, module.weight[0].numel(), out_per_group)
    if module.in_channels // groups >= _GROUPED_CONV_MIN_CHANNELS and method != "gram":
        if method == "sketch":
            return _sketched_weight_sq_norms(module, inp, grad_output)
        grads = per_example_weight_grads(module, inp, grad_output)
        return grads.reshape(batch_size, -1).square_().sum(dim=1)  # in place: no second (B·out, in, *kernel) buffer
    columns = unfold_input(module, inp)  # channel-major, so each group is a contiguous block
    columns = columns.reshape(batch_size * groups, -1, positions).transpose(1, 2)
    group_grads = grad_output.reshape(batch_size * groups, out_per_group, positions).transpose(1, 2)
    return sequence_sq_norms(columns, group_grads).reshape(batch_size, groups).sum(dim=1)


def _sketched_weight_sq_norms(module: nn.Conv1d | nn.Conv2d, inp: Tensor, grad_output: Tensor) -> Tensor:
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


def per_example_weight_grads(module: nn.Conv1d | nn.Conv2d, inp: Tensor, grad_output: Tensor,
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
    return torch.nn.grad.conv2d_weight(
        inp.reshape(1, -1, *inp.shape[2:]), weight_shape, grad_output.reshape(1, -1, *grad_output.shape[2:]),
        stride=stride, padding=padding, dilation=dilation, groups=batch_size * groups,
    )


def _padded(module: nn.Conv1d | nn.Conv2d, inp: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """``inp`` and the padding left for the convolution: symmetric zero padding is left to it (no copy); any
    other (``'same'``'s possibly asymmetric amounts, non-zero modes) is applied here, as ``_ConvNd`` does."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return inp, tuple(module.padding)
    padding = module._reversed_padding_repeated_twice
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    spatial = 1 if isinstance(module, nn.Conv1d) else 2
    return (F.pad(inp, padding, mode=mode) if any(padding) else inp), (0,) * spatial


def conv_summed_grads(
    module: nn.Conv1d | nn.Conv2d,
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
        weight_grad = torch.nn.grad.conv1d_weight if isinstance(module, nn.Conv1d) else torch.nn.grad.conv2d_weight
        summed["weight"] = weight_grad(padded, module.weight.shape, grad_output, stride=module.stride,
                                       padding=padding, dilation=module.dilation, groups=module.groups)
    if includes_param(module, "bias", param_names):
        summed["bias"] = grad_output.transpose(0, 1).reshape(module.out_channels, -1).sum(dim=1)
    return summed
