"""``nn.RNNCell``, ``nn.LSTMCell`` and ``nn.GRUCell`` applied by a loop of one's own, against per-example backward
passes."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.cells import cell_call, state_feeds_output

BATCH, LENGTH, FEATURES, HIDDEN = 3, 5, 4, 6
CELLS = {"RNNCell tanh": lambda **o: nn.RNNCell(FEATURES, HIDDEN, **o),
         "RNNCell relu": lambda **o: nn.RNNCell(FEATURES, HIDDEN, nonlinearity="relu", **o),
         "LSTMCell": lambda **o: nn.LSTMCell(FEATURES, HIDDEN, **o),
         "GRUCell": lambda **o: nn.GRUCell(FEATURES, HIDDEN, **o)}


class Loop(nn.Module):
    """The cell over the steps; a head on every step's ``h`` and, for LSTM, one on the last ``c``. ``use_state``: an
    initial state that depends on the example."""

    def __init__(self, cell: nn.Module, use_state: bool = False) -> None:
        super().__init__()
        self.cell, self.use_state = cell, use_state
        self.steps, self.last = nn.Linear(HIDDEN, 2), nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hx = None
        if self.use_state:
            h0 = x.mean(1)[:, :1].expand(x.shape[0], HIDDEN)
            hx = (h0, 0.5 * h0) if isinstance(self.cell, nn.LSTMCell) else h0
        out = 0.0
        for t in range(x.shape[1]):
            hx = self.cell(x[:, t], hx)
            out = out + self.steps(hx[0] if isinstance(hx, tuple) else hx)
        return out + (self.last(hx[1]) if isinstance(hx, tuple) else 0.0)


def reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.5, 2, dtype=x.dtype)
    params = [p for name, p in model.named_parameters() if isinstance(model.cell, nn.LSTMCell) or "last" not in name]
    return torch.stack([sum(g.square().sum() for g in torch.autograd.grad((model(x[i:i + 1]) * weights).sum(), params))
                        for i in range(x.shape[0])])


def tracked(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1.0, 1.5, 2, dtype=x.dtype)
    with PerExampleNormTracker(model) as tracker:
        assert tracker.coverage_fraction() == 1.0
        tracker.expected_batch_size = x.shape[0]
        (model(x) * weights).sum().backward()
        return tracker.pop()


CASES = list(itertools.product(CELLS, [True, False], [False, True]))


@pytest.mark.parametrize("name, bias, use_state", CASES,
                         ids=[f"{n}-{'bias' if b else 'nobias'}-{'state' if s else 'zeros'}" for n, b, s in CASES])
def test_every_cell_matches_per_example_backward_passes(name, bias, use_state) -> None:
    torch.manual_seed(0)
    model = Loop(CELLS[name](bias=bias), use_state).double()
    x = torch.randn(BATCH, LENGTH, FEATURES, dtype=torch.float64)
    torch.testing.assert_close(tracked(model, x).double(), reference(model, x), rtol=1e-6, atol=0)  # float32 sums


def test_a_fused_cell_s_state_gradient_is_its_own() -> None:
    """Where one node returns ``h`` and ``c`` (CUDA's fused cell), ``c``'s gradient leaves out the path through
    ``h``, which the call adds: checked against autograd through the cell's own equations."""
    torch.manual_seed(1)
    cell = nn.LSTMCell(FEATURES, HIDDEN).double()
    x, h, c = (torch.randn(BATCH, n, dtype=torch.float64) for n in (FEATURES, HIDDEN, HIDDEN))
    gi = F.linear(x, cell.weight_ih, cell.bias_ih).detach().requires_grad_()
    i, f, g, o = (gi + F.linear(h, cell.weight_hh, cell.bias_hh)).chunk(4, -1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h_new = torch.sigmoid(o) * torch.tanh(c_new)
    dh, dc = torch.randn_like(h), torch.randn_like(c)
    (expected,) = torch.autograd.grad((h_new * dh).sum() + (c_new * dc).sum(), gi)
    torch.testing.assert_close(cell_call(cell, x, (h, c), [dh, dc], state_grad_is_total=False).gi_grad, expected)


def test_the_graph_says_whose_state_gradient_is_total() -> None:
    """torch's CPU LSTM cell computes ``h`` from the ``c`` it returns; a GRU returns ``h`` alone; one node's two
    outputs feed neither into the other."""
    x = torch.randn(BATCH, FEATURES)
    assert state_feeds_output(nn.LSTMCell(FEATURES, HIDDEN)(x))
    assert not state_feeds_output(nn.GRUCell(FEATURES, HIDDEN)(x))
    both = torch.randn(2, BATCH, HIDDEN, requires_grad=True).unbind(0)
    assert not state_feeds_output(tuple(both))


def test_an_unbatched_call_stops_measuring_with_the_reason() -> None:
    cell = nn.GRUCell(FEATURES, HIDDEN)
    with PerExampleNormTracker(cell) as tracker:
        cell(torch.randn(FEATURES)).sum().backward()
        with pytest.raises(RuntimeError, match="not a batched 2-D tensor"):
            tracker.pop()


def test_a_cell_model_is_covered_and_no_subset_is_taken() -> None:
    model = Loop(nn.LSTMCell(FEATURES, HIDDEN))
    with PerExampleNormTracker(model, max_examples=1) as tracker:
        assert tracker.coverage_fraction() == 1.0
        model(torch.randn(BATCH, LENGTH, FEATURES)).sum().backward()
        passes = tracker.pop_passes()
    assert passes[0].subset is False and passes[0].sq_norms.shape == (BATCH,)
