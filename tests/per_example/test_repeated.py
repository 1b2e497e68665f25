"""A layer applied several times in one forward pass, measured as one call over all its calls, against
``torch.func`` (:mod:`gns_callback.per_example.repeated`)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import PerExampleNormTracker

BATCH = 5


class HandWrittenRnn(nn.Module):
    """``h_t = tanh(W_x·x_t + W_h·h_{t−1})`` with two ``nn.Linear`` applied at every step, then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.input, self.hidden, self.head = nn.Linear(4, 6), nn.Linear(6, 6, bias=False), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 6)
        for t in range(x.shape[1]):
            h = torch.tanh(self.input(x[:, t]) + self.hidden(h))
        return self.head(h)


class Siamese(nn.Module):
    """One encoder (Linear, LayerNorm, Linear on a sequence) applied to both halves of the input."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 6))
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x.chunk(2, dim=1)
        return self.head(torch.cat([self.encode(left).mean(1), self.encode(right).mean(1)], -1))


class TokensTwice(nn.Module):
    """One embedding looked up for two token sequences of different lengths, an RMSNorm applied to both."""

    def __init__(self) -> None:
        super().__init__()
        self.table, self.norm, self.head = nn.Embedding(7, 4), nn.RMSNorm(4), nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        first, second = self.norm(self.table(tokens[:, :3])), self.norm(self.table(tokens[:, 3:]))
        return self.head(first.sum(1) - second.mean(1))


CASES = {
    "hand-written recurrence": (HandWrittenRnn, lambda: torch.randn(BATCH, 7, 4, dtype=torch.float64)),
    "siamese encoder": (Siamese, lambda: torch.randn(BATCH, 8, 4, dtype=torch.float64)),
    "embedding and RMSNorm twice": (TokensTwice, lambda: torch.randint(0, 7, (BATCH, 8))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_per_example_gradients(name: str, reference_sq_norms) -> None:
    make, inputs = CASES[name]
    model = make().double()
    x = inputs()
    weights = torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        assert tracker.coverage_fraction() == 1.0
        (model(x) * weights).sum().backward()
        got = tracker.pop()
    torch.testing.assert_close(got.double(), reference_sq_norms(model, x, weights), rtol=1e-5, atol=0)


def test_a_subset_of_examples_reads_the_calls_summed_gradient() -> None:
    """With a subset measured, the unmeasured examples' summed gradient is the pass's gradient minus the subset's,
    over every call."""
    model = HandWrittenRnn().double()
    x = torch.randn(8, 7, 4, dtype=torch.float64)
    with PerExampleNormTracker(model, max_examples=3) as tracker:
        tracker._subset_allowed, tracker.expected_batch_size = True, 8
        tracker._measures_subset = lambda record, batch: setattr(record, "subset", True) or True  # force it
        model(x).sum().backward()
        (record,) = tracker.pop_passes()
    rest = x[3:]
    grads = torch.autograd.grad(model(rest).sum(), list(model.parameters()))
    assert record.subset and record.unmeasured_sq.item() == pytest.approx(sum(g.square().sum() for g in grads).item())


def _assert_refused_as_a_table(rows: int, table) -> None:
    """``logits = project(x) @ project(table(prototypes)).T`` with ``rows`` prototypes: the second call's rows are
    prototypes, not examples, and the tracker refuses it for running on a parameter."""

    class Prototypes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.project, self.prototypes = nn.Linear(4, 6), nn.Parameter(torch.randn(rows, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.project(x) @ self.project(table(self.prototypes)).T

    model = Prototypes()
    with PerExampleNormTracker(model) as tracker:
        tracker.expected_batch_size = BATCH
        model(torch.randn(BATCH, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="ran on a learned parameter"):
            tracker.pop()


@pytest.mark.parametrize("rows", [BATCH, 10])
def test_a_layer_run_on_a_learned_table_stops_measuring_even_with_as_many_rows_as_examples(rows: int) -> None:
    """With as many prototypes as examples the shape can't tell them apart; it is refused for running on a
    parameter."""
    _assert_refused_as_a_table(rows, lambda p: p)


def test_a_learned_table_broadcast_over_the_batch_is_measured(reference_sq_norms) -> None:
    """Learned queries expanded to the batch (``latents.expand(B, ...)``): every example has its own rows, and
    its own output gradient through them; measured, not refused."""

    class LearnedQueries(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.latents, self.project = nn.Parameter(torch.randn(3, 4)), nn.Linear(4, 4)
            self.head = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            queries = self.project(self.latents.expand(x.shape[0], -1, -1))  # (B, 3, 4)
            return self.head((queries * x.unsqueeze(1)).mean(1))

    model = LearnedQueries().double()
    x, weights = torch.randn(BATCH, 4, dtype=torch.float64), torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        (model(x) * weights).sum().backward()
        got = tracker.pop()
        measured = {name for name, p in model.named_parameters() if any(p is q for q in tracker.covered_parameters())}
    torch.testing.assert_close(got.double(), reference_sq_norms(model, x, weights, measured), rtol=1e-5, atol=0)


@pytest.mark.parametrize("table", [lambda p: 2 * p, lambda p: p / 4, lambda p: p * nn.Parameter(torch.tensor(0.5))],
                         ids=["2 * prototypes", "prototypes / 4", "prototypes * learned scale"])
def test_a_layer_run_on_a_table_computed_from_a_parameter_stops_measuring(table) -> None:
    """``project(2 * prototypes)``: the rows are still prototypes, as many as the examples here. Before, only a
    parameter itself was told from the examples, and a plain loop at its defaults read these rows as examples:
    B_simple = 11.1 (95% CI 10.9-11.4) on the digits against an exact 5.5, whole or of the parameters it measured."""

    _assert_refused_as_a_table(BATCH, table)
