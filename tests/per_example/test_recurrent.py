"""``nn.RNN``, ``nn.LSTM`` and ``nn.GRU`` (recomputed step by step) against per-example backward passes."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.recurrent import recompute, recurrent_param_names, recurrent_sq_norms

BATCH, LENGTH, FEATURES, HIDDEN = 3, 6, 4, 5


class Sequence(nn.Module):
    """A recurrent module, then a Linear head on every step's output and one on the last hidden state."""

    def __init__(self, kind: type, batch_first: bool = True, use_state: bool = False, **options) -> None:
        super().__init__()
        self.batch_first, self.use_state = batch_first, use_state
        self.rnn = kind(FEATURES, HIDDEN, batch_first=batch_first, **options)
        width = HIDDEN * (2 if options.get("bidirectional") else 1)
        self.steps, self.last = nn.Linear(width, 2), nn.Linear(HIDDEN, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hx = None
        if self.use_state:  # an initial state that depends on the example
            batch = x.shape[0 if self.batch_first else 1]
            layers = self.rnn.num_layers * (2 if self.rnn.bidirectional else 1)
            h0 = x.mean(1 if self.batch_first else 0)[:, :1].expand(batch, HIDDEN).expand(layers, batch, HIDDEN)
            hx = (h0, 0.5 * h0) if isinstance(self.rnn, nn.LSTM) else h0
        out, hidden = self.rnn(x, hx)
        h_n = hidden[0] if isinstance(hidden, tuple) else hidden
        return self.steps(out).sum(1 if self.batch_first else 0) + self.last(h_n[-1])


def per_example_reference(model: nn.Module, inputs: torch.Tensor, batch_dim: int, names: set[str]) -> torch.Tensor:
    """``Σ |∇ (model(x_i)·R_i).sum()|²`` over the parameters ``names``, one backward pass per example."""
    params = [p for name, p in model.named_parameters() if name in names]
    weights = torch.linspace(-1.0, 1.5, 2, dtype=inputs.dtype)
    norms = []
    for i in range(inputs.shape[batch_dim]):
        grads = torch.autograd.grad((model(inputs.narrow(batch_dim, i, 1)) * weights).sum(), params)
        norms.append(sum(g.double().square().sum() for g in grads))
    return torch.stack(norms)


def covered(model: nn.Module, tracker: PerExampleNormTracker) -> set[str]:
    ids = {id(p) for p in tracker.covered_parameters()}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def measure(model: nn.Module, inputs: torch.Tensor, batch_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tracker's per-example squared norms, the reference over the parameters it covers)."""
    weights = torch.linspace(-1.0, 1.5, 2, dtype=inputs.dtype)
    with PerExampleNormTracker(model) as tracker:
        assert tracker.coverage_fraction() == 1.0
        tracker.expected_batch_size = inputs.shape[batch_dim]
        (model(inputs) * weights).sum().backward()
        got = tracker.pop()
        names = covered(model, tracker)
    return got, per_example_reference(model, inputs, batch_dim, names).float()


CASES = list(itertools.product([nn.RNN, nn.LSTM, nn.GRU], [1, 2], [False, True], [True, False]))


@pytest.mark.parametrize("kind, layers, bidirectional, batch_first", CASES,
                         ids=[f"{k.__name__}-{n}layer-{'bi' if b else 'uni'}-{'bf' if f else 'sf'}"
                              for k, n, b, f in CASES])
def test_every_configuration_matches_per_example_backward_passes(kind, layers, bidirectional, batch_first) -> None:
    torch.manual_seed(0)
    model = Sequence(kind, batch_first, num_layers=layers, bidirectional=bidirectional).double()
    shape = (BATCH, LENGTH, FEATURES) if batch_first else (LENGTH, BATCH, FEATURES)
    got, expected = measure(model, torch.randn(*shape, dtype=torch.float64), 0 if batch_first else 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", [nn.RNN, nn.LSTM, nn.GRU])
def test_an_initial_state_no_biases_and_relu(kind) -> None:
    torch.manual_seed(1)
    options = dict(nonlinearity="relu") if kind is nn.RNN else {}
    model = Sequence(kind, use_state=True, bias=False, num_layers=2, **options).double()
    with PerExampleNormTracker(model) as tracker:
        assert tracker.coverage_fraction() == 1.0
    got, expected = measure(model, torch.randn(BATCH, LENGTH, FEATURES, dtype=torch.float64), 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", [nn.RNN, nn.LSTM, nn.GRU])
def test_the_recomputation_is_the_modules_forward(kind) -> None:
    torch.manual_seed(2)
    module = kind(FEATURES, HIDDEN, num_layers=2, bidirectional=True).double()
    x = torch.randn(LENGTH, BATCH, FEATURES, dtype=torch.float64)
    out, hidden = module(x)
    again = recompute(module, x)
    torch.testing.assert_close(again.output, out.transpose(0, 1))
    torch.testing.assert_close(again.h_n, hidden[0] if kind is nn.LSTM else hidden)
    if kind is nn.LSTM:
        torch.testing.assert_close(again.c_n, hidden[1])


def test_only_the_last_hidden_state_in_the_loss() -> None:
    """The loss reads ``c_n`` and not ``output``: the output's gradient is None, the norms still exact."""
    torch.manual_seed(3)
    module = nn.LSTM(FEATURES, HIDDEN, batch_first=True).double()
    x = torch.randn(BATCH, LENGTH, FEATURES, dtype=torch.float64)
    _, (_, c_n) = module(x)
    grad = torch.autograd.grad(c_n.sum(), c_n)[0]
    got = recurrent_sq_norms(module, x, None, [None, None, grad], recurrent_param_names(module))
    expected = []
    for i in range(BATCH):
        grads = torch.autograd.grad(module(x[i:i + 1])[1][1].sum(), list(module.parameters()))
        expected.append(sum(g.square().sum() for g in grads))
    torch.testing.assert_close(got, torch.stack(expected))


def test_the_module_is_covered_and_no_subset_is_taken() -> None:
    model = Sequence(nn.LSTM, num_layers=2, bidirectional=True)
    with PerExampleNormTracker(model, max_examples=1) as tracker:
        assert tracker.coverage_fraction() == 1.0
        model(torch.randn(BATCH, LENGTH, FEATURES)).sum().backward()
        passes = tracker.pop_passes()
    assert passes[0].subset is False and passes[0].sq_norms.shape == (BATCH,)


@pytest.mark.parametrize("options, words", [(dict(num_layers=2, dropout=0.5), "dropout between the layers"),
                                            (dict(proj_size=3), "proj_size")])
def test_options_the_recomputation_cannot_follow_are_left_out_with_the_reason(options, words) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about dropout with one layer; not this test's matter
        model = Sequence(nn.LSTM, **options)
    with PerExampleNormTracker(model) as tracker:
        assert any(name.startswith("rnn.") and words in reason for name, reason in tracker.excluded_reasons.items())
        assert not any(name.startswith("rnn.") for name in covered(model, tracker))


def test_a_packed_sequence_stops_measuring_with_the_reason() -> None:
    module = nn.GRU(FEATURES, HIDDEN, batch_first=True)
    x = torch.randn(BATCH, LENGTH, FEATURES)
    with PerExampleNormTracker(module) as tracker:
        out, _ = module(pack_padded_sequence(x, [6, 4, 2], batch_first=True))
        out.data.sum().backward()
        with pytest.raises(RuntimeError, match="PackedSequence.*pass a padded batch"):
            tracker.pop()


def test_a_module_applied_twice_stops_measuring() -> None:
    module = nn.RNN(FEATURES, FEATURES, batch_first=True)
    x = torch.randn(BATCH, LENGTH, FEATURES)
    with PerExampleNormTracker(module) as tracker:
        module(module(x)[0])[0].sum().backward()
        with pytest.raises(RuntimeError, match="applied more than once"):
            tracker.pop()


def test_the_wrong_batch_dim_stops_measuring() -> None:
    """``batch_first=False`` fed a batch-first tensor: the batch is not where the module reads it."""
    module = nn.LSTM(FEATURES, HIDDEN)
    with PerExampleNormTracker(module) as tracker:
        tracker.expected_batch_size = BATCH
        module(torch.randn(BATCH, LENGTH, FEATURES))[0].sum().backward()
        with pytest.raises(RuntimeError, match=r"batch_first=False its input \(L, N, E\) holds 6 examples"):
            tracker.pop()
