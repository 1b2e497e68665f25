"""``nn.PReLU``: per-example norms of its slope(s) against ``torch.func``, on its own and called several times."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example.activation import prelu_sq_norms


@pytest.mark.parametrize("num_parameters", [1, 4])
@pytest.mark.parametrize("shape", [(5, 4), (5, 4, 3), (5, 4, 3, 2)])
def test_prelu(num_parameters: int, shape: tuple[int, ...], reference_sq_norms) -> None:
    module = nn.PReLU(num_parameters, init=0.3).double()
    x = torch.randn(shape, dtype=torch.float64)
    weights = torch.randn_like(module(x))
    torch.testing.assert_close(prelu_sq_norms(module, x, weights), reference_sq_norms(module, x, weights),
                               rtol=1e-9, atol=0)


class OneActivation(nn.Module):
    """One ``nn.PReLU`` after every layer, as such code often has it: its calls' gradients add up per example."""

    def __init__(self, num_parameters: int) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv1d(4, 4, 3, padding=1), nn.PReLU(num_parameters, init=0.2)
        self.head = nn.Linear(4 * 6, 3)

    def forward(self, x):
        return self.head(self.act(self.conv(self.act(x))).flatten(1))


@pytest.mark.parametrize("num_parameters", [1, 4])
def test_one_prelu_called_several_times_is_measured_over_all_its_calls(num_parameters: int, tracked_whole) -> None:
    tracked_whole(OneActivation(num_parameters).double(), torch.randn(5, 4, 6, dtype=torch.float64), 1e-5)
