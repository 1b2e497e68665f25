"""Per-example squared gradient norms for ``nn.ConvTranspose1d`` / ``2d`` / ``3d``, as a convolution's.

A transposed convolution is the input gradient of a convolution: with ``B(u, W, v) = ⟨v, conv(u; W)⟩``, which is
linear in each argument, ``conv_transpose(x; W) = ∇_u B(·, W, x)`` for the convolution ``conv`` with the same
kernel, stride, padding, dilation and groups from ``out_channels`` to ``in_channels`` channels (its weight
``(in, out/groups, *kernel)`` is the transposed convolution's own). So for the output gradient ``δ``,
``⟨δ, conv_transpose(x; W)⟩ = B(δ, W, x)``, and ``∇_W`` is that convolution's weight gradient with ``δ`` as its
input and ``x`` as its output gradient (Dumoulin & Visin 2016, "A guide to convolution arithmetic", §4). Each
example's is therefore :mod:`.conv`'s per-example weight gradient with the two roles swapped; the bias is
``Σ_p δ_{i,p}`` as a convolution's. ``output_padding`` only adds rows at the end of the output that the
convolution of ``δ`` leaves out of its windows, as the forward does. Checked against per-example backward passes in
``tests/per_example/test_conv_transpose.py``. Torch only.
"""

from __future__ import annotations

from collections.abc import Collection
from functools import lru_cache
from typing import Union

from torch import Tensor, nn

from .conv import ConvNd, conv_summed_grads, conv_weight_sq_norms, spatial_dims
from .linear import includes_param, upcast

__all__ = ["conv_transpose_sq_norms", "conv_transpose_summed_grads", "shadow_convolution"]

ConvTranspose = Union[nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d]
_CONVOLUTIONS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}  # by spatial dims


def shadow_convolution(module: ConvTranspose) -> ConvNd:
    """The convolution whose input gradient ``module`` computes, on the meta device (no memory): ``out_channels``
    → ``in_channels``, the same kernel, stride, padding, dilation and groups, no bias. One per shape, built once
    (building a module takes about 0.1 ms, and this runs at every step)."""
    return _shadow(spatial_dims(module), module.out_channels, module.in_channels,
                   tuple(module.kernel_size), tuple(module.stride), tuple(module.padding), tuple(module.dilation),
                   module.groups)


@lru_cache(maxsize=64)
def _shadow(spatial_dims: int, in_channels: int, out_channels: int, kernel_size: tuple, stride: tuple,
            padding: tuple, dilation: tuple, groups: int) -> ConvNd:
    return _CONVOLUTIONS[spatial_dims](in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                                       dilation=dilation, groups=groups, bias=False, device="meta")


def conv_transpose_sq_norms(module: ConvTranspose, inp: Tensor, grad_output: Tensor, *,
                            param_names: Collection[str] | None = None) -> Tensor:
    """Per-example squared gradient norm ``(B,)`` of a transposed convolution's trainable weight and bias (module
    docstring): the weight's from the shadow convolution with input ``grad_output`` and output gradient ``inp``."""
    inp, grad_output = upcast(inp, grad_output)
    batch_size = inp.shape[0]
    total = inp.new_zeros(batch_size)
    if includes_param(module, "weight", param_names):
        total = total + conv_weight_sq_norms(shadow_convolution(module), grad_output, inp)
    if includes_param(module, "bias", param_names):
        total = total + grad_output.reshape(batch_size, module.out_channels, -1).sum(dim=-1).square().sum(dim=1)
    return total


def conv_transpose_summed_grads(module: ConvTranspose, inp: Tensor, grad_output: Tensor, *,
                                param_names: Collection[str] | None = None) -> dict[str, Tensor]:
    """The gradient these examples alone contribute (weight as the shadow convolution's, bias ``Σ δ``)."""
    inp, grad_output = upcast(inp, grad_output)
    summed: dict[str, Tensor] = {}
    if includes_param(module, "weight", param_names):
        summed["weight"] = conv_summed_grads(shadow_convolution(module), grad_output, inp,
                                             param_names={"weight"})["weight"]
    if includes_param(module, "bias", param_names):
        summed["bias"] = grad_output.transpose(0, 1).reshape(module.out_channels, -1).sum(dim=1)
    return summed
