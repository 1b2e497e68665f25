"""``nn.ConvTranspose1d`` / ``2d`` / ``3d`` (a convolution's input gradient) against ``torch.func``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example.conv_transpose import conv_transpose_sq_norms
from gns_callback.per_example.cost import conv_transpose_costs, subset_is_cheaper

CONFIGS = {
    "plain": dict(kernel_size=3),
    "stride 2, padding, output padding": dict(kernel_size=3, stride=2, padding=1, output_padding=1),
    "dilated, no bias": dict(kernel_size=2, dilation=2, bias=False),
    "groups": dict(kernel_size=3, stride=2, groups=2),
    "wide (the grouped weight-gradient convolution)": dict(kernel_size=3, stride=2, channels=(16, 12)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dims", [1, 2, 3])
def test_matches_per_example_gradients(name: str, dims: int, reference_sq_norms) -> None:
    options = dict(CONFIGS[name])
    channels_in, channels_out = options.pop("channels", (4, 6))
    layer = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[dims](channels_in, channels_out,
                                                                                       **options).double()
    inputs = torch.randn(5, channels_in, *([7, 6, 5][:dims]), dtype=torch.float64)
    weights = torch.randn_like(layer(inputs))
    got = conv_transpose_sq_norms(layer, inputs, weights)
    torch.testing.assert_close(got, reference_sq_norms(layer, inputs, weights), rtol=1e-9, atol=0)


AUTOENCODERS = {  # before, their decoders were left out of both norms
    "2-D, digits-sized": (lambda: nn.Sequential(nn.Conv2d(1, 8, 3, stride=2, padding=1), nn.Tanh(),
                                                nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1),
                                                nn.Tanh(), nn.ConvTranspose2d(4, 1, 3, padding=1)), (6, 1, 8, 8)),
    "3-D": (lambda: nn.Sequential(nn.Conv3d(1, 4, 3, stride=2, padding=1), nn.Tanh(),
                                  nn.ConvTranspose3d(4, 2, 3, stride=2, padding=1, output_padding=1), nn.Tanh(),
                                  nn.ConvTranspose3d(2, 1, 3, padding=1)), (4, 1, 6, 4, 6)),
}


@pytest.mark.parametrize("name", list(AUTOENCODERS))
def test_a_convolutional_autoencoder_is_covered_whole_by_the_tracker(name: str, tracked_whole) -> None:
    """Convolutions down, transposed convolutions up: every parameter measured, each example's norm its own."""
    build, shape = AUTOENCODERS[name]
    tracked_whole(build().double(), torch.randn(shape, dtype=torch.float64), 1e-5)


def test_the_cost_is_the_shadow_convolution_s() -> None:
    """Over the input positions, ``out·kernel`` in, ``in`` out: a wide upsampling layer at batch 64 measures a
    subset only when its norms are materialised, as a convolution of that shape would."""
    layer = nn.ConvTranspose2d(8, 16, 3, stride=2, padding=1, output_padding=1)
    inp = torch.zeros(64, 8, 16, 16)
    norm, summed = conv_transpose_costs(layer, inp, layer(inp), 64)
    assert summed == 256 * (16 * 9) * 8
    assert subset_is_cheaper([(norm, summed, layer.weight.numel())], batch=64, measured=16)
