"""``transformers``' ``Conv1D`` (GPT-2's attention and MLP projections): per-example norms against ``torch.func``.

``Conv1D`` below is a verbatim copy of ``transformers.pytorch_utils.Conv1D`` (4.46, Apache-2.0), so the tests need
no ``transformers``; the last test runs the real GPT-2 where ``transformers`` is installed."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.transposed_linear import (
    TransposedLinear, is_transposed_linear, layer_kind, transposed_linear_summed_grads,
)

from .conftest import per_example_sq_norms_reference


class Conv1D(nn.Module):
    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.nx = nx
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        x = x.view(size_out)
        return x


class Gpt2Mlp(nn.Module):
    """GPT-2's MLP: ``c_fc`` (d → 4d) and ``c_proj`` (4d → d), both ``Conv1D``, around a LayerNorm."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.ln, self.c_fc, self.c_proj = nn.LayerNorm(d), Conv1D(4 * d, d), Conv1D(d, 4 * d)
        with torch.no_grad():
            self.c_fc.bias.normal_(), self.c_proj.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(torch.tanh(self.c_fc(self.ln(x))))


def test_conv1d_is_recognised_by_its_shape_contract() -> None:
    assert layer_kind(Conv1D(5, 3)) is TransposedLinear and is_transposed_linear(Conv1D(5, 3))
    assert layer_kind(nn.Linear(3, 5)) is nn.Linear
    wrong = Conv1D(5, 3)
    wrong.nf = 4  # no longer y = x @ W + b with W (nx, nf)
    assert not is_transposed_linear(wrong)


@pytest.mark.parametrize("shape", [(7, 6), (7, 5, 6)], ids=["one vector per example", "a sequence per example"])
def test_per_example_norms_match_torch_func(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = Gpt2Mlp().double()
    inputs = torch.randn(*shape, dtype=torch.float64)
    weights = torch.randn(*shape, dtype=torch.float64)
    tracker = PerExampleNormTracker(model).attach()
    assert tracker.coverage_fraction() == 1.0
    (model(inputs) * weights).sum().backward()
    got = tracker.pop().double()
    torch.testing.assert_close(got, per_example_sq_norms_reference(model, inputs, weights), rtol=1e-5, atol=0)


def test_a_subsets_summed_gradient_is_the_weights_own_shape() -> None:
    """``(nx, nf)``, equal to autograd's gradient of the subset's loss."""
    torch.manual_seed(0)
    layer = Conv1D(5, 3).double()
    x, weights = torch.randn(4, 2, 3, dtype=torch.float64), torch.randn(4, 2, 5, dtype=torch.float64)
    (layer(x[:3]) * weights[:3]).sum().backward()
    summed = transposed_linear_summed_grads(layer, x[:3], weights[:3])
    torch.testing.assert_close(summed["weight"], layer.weight.grad)
    torch.testing.assert_close(summed["bias"], layer.bias.grad)


def test_the_real_gpt2_is_measured_exactly() -> None:
    """Hugging Face GPT-2 (tiny config): Conv1D projections, the head tied to the token table, position ids of shape
    (1, T) read as a shared table at its broadcast: every parameter measured, exactly."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=23, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    torch.manual_seed(0)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gpt = transformers.GPT2LMHeadModel(config).double()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.gpt(input_ids=ids).logits

    model = Logits()
    ids, weights = torch.randint(23, (5, 8)), torch.randn(5, 8, 23, dtype=torch.float64)
    tracker = PerExampleNormTracker(model).attach()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        (model(ids) * weights).sum().backward()
    got = tracker.pop().double()
    assert {id(p) for p in tracker.covered_parameters()} == {id(p) for p in model.parameters()}
    torch.testing.assert_close(got, per_example_sq_norms_reference(model, ids, weights), rtol=1e-6, atol=0)
