from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import conv_sq_norms, prefers_gram

CONV1D_CASES = [
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=4, padding="same", dilation=2, groups=2),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding="valid", groups=4, bias=False),
    dict(in_channels=4, out_channels=6, kernel_size=3, padding=2, padding_mode="circular"),
    dict(in_channels=4, out_channels=6, kernel_size=3, stride=2, padding=1, padding_mode="reflect"),
    dict(in_channels=2, out_channels=4, kernel_size=2, padding="same", padding_mode="replicate"),
]

CONV2D_CASES = [
    dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=(2, 3), padding="same", dilation=(1, 2), groups=2),
    dict(in_channels=4, out_channels=4, kernel_size=3, padding=1, groups=4, bias=False),
    dict(in_channels=3, out_channels=4, kernel_size=3, padding="valid", dilation=2),
    dict(in_channels=3, out_channels=4, kernel_size=3, padding=1, padding_mode="reflect"),
    dict(
        in_channels=4, out_channels=6, kernel_size=3, stride=(2, 1), padding=(1, 2),
        padding_mode="circular", groups=2,
    ),
    dict(
        in_channels=2, out_channels=4, kernel_size=(2, 2), padding="same", padding_mode="reflect",
        bias=False,
    ),
]


CONV3D_CASES = [
    dict(in_channels=2, out_channels=3, kernel_size=3, stride=2, padding=1),
    dict(in_channels=4, out_channels=6, kernel_size=(2, 3, 1), padding="same", dilation=(2, 1, 1), groups=2),
    dict(in_channels=3, out_channels=4, kernel_size=2, padding=1, padding_mode="replicate", bias=False),
    dict(in_channels=2, out_channels=4, kernel_size=3, padding=1, padding_mode="circular"),
    dict(in_channels=8, out_channels=6, kernel_size=3, stride=(1, 2, 1), padding=1),  # the grouped weight gradient
]


def _check(module: nn.Module, x: torch.Tensor, reference_sq_norms) -> None:
    weights = torch.randn_like(module(x))
    got = conv_sq_norms(module, x, weights)
    assert got.shape == (x.shape[0],)
    torch.testing.assert_close(got, reference_sq_norms(module, x, weights), rtol=1e-4, atol=1e-10)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("config", CONV1D_CASES, ids=str)
def test_conv1d(config: dict, reference_sq_norms) -> None:
    module = nn.Conv1d(**config).double()
    _check(module, torch.randn(3, module.in_channels, 9, dtype=torch.float64), reference_sq_norms)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("config", CONV2D_CASES, ids=str)
def test_conv2d(config: dict, reference_sq_norms) -> None:
    module = nn.Conv2d(**config).double()
    _check(module, torch.randn(3, module.in_channels, 7, 6, dtype=torch.float64), reference_sq_norms)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("config", CONV3D_CASES, ids=str)
def test_conv3d(config: dict, reference_sq_norms) -> None:
    module = nn.Conv3d(**config).double()
    _check(module, torch.randn(3, module.in_channels, 5, 6, 4, dtype=torch.float64), reference_sq_norms)


@pytest.mark.parametrize(
    ("in_channels", "out_channels", "kernel_size", "spatial", "gram"),
    [(8, 16, 3, 4, True), (2, 2, 1, 6, False)],
)
def test_conv2d_gram_and_materialised_paths(
    in_channels: int, out_channels: int, kernel_size: int, spatial: int, gram: bool, reference_sq_norms
) -> None:
    module = nn.Conv2d(in_channels, out_channels, kernel_size).double()
    positions = (spatial - kernel_size + 1) ** 2
    assert prefers_gram(positions, in_channels * kernel_size**2, out_channels) is gram
    _check(module, torch.randn(2, in_channels, spatial, spatial, dtype=torch.float64), reference_sq_norms)


GROUPED_CONV_CASES = [  # enough input channels per group for the grouped weight-gradient convolution
    dict(in_channels=8, out_channels=6, kernel_size=3, stride=2, padding=1),
    dict(in_channels=16, out_channels=4, kernel_size=2, padding="same", dilation=2, groups=2, bias=False),
    dict(in_channels=8, out_channels=6, kernel_size=3, padding=1, padding_mode="reflect"),
    dict(in_channels=8, out_channels=4, kernel_size=3, stride=2, padding=2, padding_mode="circular"),
    dict(in_channels=8, out_channels=3, kernel_size=1, padding="valid"),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize("conv_cls", [nn.Conv1d, nn.Conv2d, nn.Conv3d])
@pytest.mark.parametrize("config", GROUPED_CONV_CASES, ids=str)
def test_grouped_convolution_path(conv_cls: type[nn.Module], config: dict, reference_sq_norms) -> None:
    module = conv_cls(**config).double()
    extent = {nn.Conv1d: (40,), nn.Conv2d: (12, 11), nn.Conv3d: (6, 5, 7)}[conv_cls]
    shape = (3, module.in_channels, *extent)
    x = torch.randn(shape, dtype=torch.float64)
    positions = module(x)[0, 0].numel()
    assert not prefers_gram(positions, module.weight[0].numel(), module.out_channels // module.groups)
    _check(module, x, reference_sq_norms)


@pytest.mark.parametrize("conv_cls", [nn.Conv1d, nn.Conv2d, nn.Conv3d])
def test_frozen_weight_trainable_bias(conv_cls: type[nn.Module], reference_sq_norms) -> None:
    module = conv_cls(4, 6, 3, padding=1, groups=2).double()
    module.weight.requires_grad_(False)
    shape = {nn.Conv1d: (3, 4, 8), nn.Conv2d: (3, 4, 5, 5), nn.Conv3d: (3, 4, 4, 5, 3)}[conv_cls]
    _check(module, torch.randn(shape, dtype=torch.float64), reference_sq_norms)


def test_unbatched_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch"):
        conv_sq_norms(nn.Conv1d(2, 3, 3), torch.randn(2, 8), torch.randn(3, 6))


@pytest.mark.parametrize(
    "shape, kernel, dilation, stride",
    [((2, 3, 9, 11), (3, 3), (1, 1), (1, 1)), ((2, 4, 10, 7), (2, 3), (2, 1), (2, 3)), ((1, 2, 1, 13), (1, 4), (1, 2), (1, 2))],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_strided_im2col_equals_unfold(shape, kernel, dilation, stride, channels_last):
    from gns_callback.per_example.conv import _im2col

    x = torch.randn(shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    assert torch.equal(_im2col(x, kernel, dilation, stride), torch.nn.functional.unfold(x, kernel, dilation=dilation, stride=stride))


@pytest.mark.parametrize("channels_last", [False, True])
def test_strided_im2col_in_3d_equals_the_windows_sliced_out(channels_last):
    """In 3-D, which ``F.unfold`` does not take: each kernel offset ``(a, b, c)`` reads the input strided by the
    stride from ``offset·dilation``, stacked channel-major as ``F.unfold`` stacks them in 2-D."""
    from gns_callback.per_example.conv import _im2col

    x = torch.randn(2, 3, 7, 6, 5)
    if channels_last:
        x = x.to(memory_format=torch.channels_last_3d)
    kernel, dilation, stride = (2, 3, 2), (2, 1, 1), (2, 1, 2)
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, d, s in zip(x.shape[2:], kernel, dilation, stride)]
    windows = torch.stack([
        x[:, :, a * dilation[0]:: stride[0], b * dilation[1]:: stride[1], c * dilation[2]:: stride[2]][
            :, :, : out[0], : out[1], : out[2]]
        for a in range(kernel[0]) for b in range(kernel[1]) for c in range(kernel[2])], dim=2)
    assert torch.equal(_im2col(x, kernel, dilation, stride), windows.reshape(2, 3 * 12, -1))
