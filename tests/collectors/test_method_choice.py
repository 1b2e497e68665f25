"""``per_example_problem``: why per-example norms can't measure a model, in words that list what they can."""

import torch
from torch import nn

from gns_callback.collectors import per_example_problem
from gns_callback.per_example import SUPPORTED_MODULES


class RawParameters(nn.Module):
    """A logistic regression written with raw parameters: no layer per-example norms know, but a matrix product's
    weight and a bias broadcast over the batch, which they read (:mod:`gns_callback.per_example.matmul`)."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


def test_a_model_of_raw_parameters_is_left_to_its_first_step():
    """Whether its weight and bias can be read shows only at the first step: no problem at fit start, every
    parameter a bare one."""
    assert per_example_problem(RawParameters()) == (None, 0.0, 1.0)


def test_a_model_with_nothing_measurable_is_told_each_reason_and_every_supported_type():
    model = nn.Sequential(nn.Embedding(5, 3, max_norm=1.0), nn.Embedding(5, 3, sparse=True))
    reason, coverage, bare = per_example_problem(model)
    assert coverage == 0.0 and bare == 0.0 and reason.startswith("no trainable parameter can be measured")
    assert "'0.weight': nn.Embedding with max_norm" in reason and "'1.weight': nn.Embedding with sparse" in reason
    for name in ["Linear", "ConvTranspose2d", "EmbeddingBag", "LayerNorm", "MultiheadAttention", "LSTM", "GRU", "RNN",
                 "x @ W"]:
        assert name in reason, name
    assert len([kind for kind in SUPPORTED_MODULES if kind.__name__ in reason]) >= len(SUPPORTED_MODULES) - 1


def test_recurrent_and_transposed_layers_are_usable():
    model = nn.Sequential(nn.LSTM(4, 4, batch_first=True))
    assert per_example_problem(model) == (None, 1.0, 0.0)
    assert per_example_problem(nn.Sequential(nn.ConvTranspose2d(2, 3, 3))) == (None, 1.0, 0.0)
