"""Each layer's ``*_summed_grads``: the gradient a set of examples contributes, against autograd."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example.tracker import SUMMED_GRADIENTS, SUPPORTED_MODULES

LAYERS = {
    "linear": (lambda: nn.Linear(5, 3), (4, 5)),
    "linear sequence": (lambda: nn.Linear(5, 3), (4, 6, 5)),
    "conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), (4, 4, 9)),
    "conv2d reflect": (lambda: nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (4, 3, 6, 6)),
    "conv2d same dilated": (lambda: nn.Conv2d(2, 4, 2, padding="same", dilation=2, bias=False), (4, 2, 5, 5)),
    "conv3d replicate, strided": (lambda: nn.Conv3d(2, 4, 3, stride=(2, 1, 1), padding=1, padding_mode="replicate"),
                                  (4, 2, 5, 4, 3)),
    "conv3d grouped": (lambda: nn.Conv3d(8, 4, 2, groups=2, bias=False), (4, 8, 3, 4, 3)),
    "conv transpose 3d": (lambda: nn.ConvTranspose3d(3, 4, 2, stride=2, output_padding=1), (4, 3, 3, 2, 3)),
    "conv transpose 1d": (lambda: nn.ConvTranspose1d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
                          (4, 4, 7)),
    "conv transpose 2d dilated": (lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, dilation=2, bias=False), (4, 3, 5, 5)),
    "layer norm 2-d shape": (lambda: nn.LayerNorm((3, 4)), (4, 2, 3, 4)),
    "group norm": (lambda: nn.GroupNorm(2, 4), (4, 4, 3, 3)),
    "rms norm": (lambda: nn.RMSNorm(5), (4, 3, 5)),
}


def test_every_supported_type_has_a_summed_gradient():
    assert set(SUMMED_GRADIENTS) == set(SUPPORTED_MODULES)


@pytest.mark.parametrize("name", LAYERS)
def test_summed_gradient_equals_autograd(name: str) -> None:
    factory, shape = LAYERS[name]
    module = factory().double()
    inp = torch.randn(shape, dtype=torch.float64)
    out = module(inp)
    weights = torch.randn_like(out)
    expected = dict(zip([n for n, _ in module.named_parameters()],
                        torch.autograd.grad((out * weights).sum(), list(module.parameters()))))
    summed = SUMMED_GRADIENTS[type(module)](module, inp, weights.detach())
    assert summed.keys() == expected.keys()
    for key, value in summed.items():
        torch.testing.assert_close(value, expected[key])


def test_embedding_summed_gradient_skips_the_padding_row() -> None:
    module = nn.Embedding(7, 3, padding_idx=0).double()
    tokens = torch.tensor([[0, 2, 2, 5], [1, 0, 6, 2]])
    out = module(tokens)
    weights = torch.randn_like(out)
    (expected,) = torch.autograd.grad((out * weights).sum(), [module.weight])
    torch.testing.assert_close(SUMMED_GRADIENTS[nn.Embedding](module, tokens, weights)["weight"], expected)


def test_param_names_restrict_the_result() -> None:
    module = nn.Linear(3, 2)
    summed = SUMMED_GRADIENTS[nn.Linear](module, torch.randn(4, 3), torch.randn(4, 2), param_names={"bias"})
    assert set(summed) == {"bias"}
