"""``per_example_problem``: why per-example norms can't measure a model, in words that list what they can."""

import torch
from torch import nn

from gns_callback.collectors import per_example_problem
from gns_callback.per_example import SUPPORTED_MODULES


class RawParameters(nn.Module):
    """A logistic regression written with raw parameters: no layer per-example norms know."""

    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.zeros(4, 3)), nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


def test_a_model_without_a_supported_layer_is_told_every_supported_type():
    reason, coverage, bare = per_example_problem(RawParameters())
    assert coverage == 0.0 and reason.startswith("no parameter is in a supported layer")
    assert bare == 1.0  # b may be read at its broadcast from the first step; w is used by a matrix product
    for name in ["Linear", "ConvTranspose2d", "EmbeddingBag", "LayerNorm", "MultiheadAttention", "LSTM", "GRU", "RNN"]:
        assert name in reason, name
    assert len([kind for kind in SUPPORTED_MODULES if kind.__name__ in reason]) >= len(SUPPORTED_MODULES) - 1


def test_recurrent_and_transposed_layers_are_usable():
    model = nn.Sequential(nn.LSTM(4, 4, batch_first=True))
    assert per_example_problem(model) == (None, 1.0, 0.0)
    assert per_example_problem(nn.Sequential(nn.ConvTranspose2d(2, 3, 3))) == (None, 1.0, 0.0)
