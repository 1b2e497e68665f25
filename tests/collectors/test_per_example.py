"""A layer applied several times in one pass, with the batch's size unknown: its calls may be the same examples (a
siamese encoder, a recurrence) or chunks of the batch; the meter measures it only where the size tells which."""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from gns_callback import GradientNoiseScaleMeter


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 10))


def chunked(model, x):
    return torch.cat([model(chunk) for chunk in x.split(16)])  # the batch through the model 16 rows at a time


def siamese(model, x):
    return model(x) + model(x.flip(1))  # each example through the model twice


def measured(digits, forward, steps: int = 12, expect: bool = False, given: bool = False, model=None):
    x, y = digits
    model, generator = model or mlp(), torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradientNoiseScaleMeter(model, method="per_example") as meter:
            for _ in range(steps):
                i = torch.randint(0, len(x), (32,), generator=generator)
                if expect:
                    meter.expect_batch_size(32)
                F.cross_entropy(forward(model, x[i]), y[i]).backward()
                meter.step(micro_batch_size=32 if given else None)
                model.zero_grad()
    return meter.run_estimate


def test_a_batch_run_in_chunks_is_refused_not_read_as_fewer_examples(digits):
    # before: B_simple 33.4 (95% CI 28.7-39.8) over 150 steps against an exact 70.3, examples i and 16 + i read as one
    for run in (measured(digits, chunked), measured(digits, chunked, expect=True),
                measured(digits, chunked, given=True)):
        assert not run.measured
    assert "expect_batch_size" in measured(digits, chunked).failure


def test_a_siamese_pass_is_measured_where_the_batch_size_is_given(digits):
    assert not measured(digits, siamese).measured  # 32 examples twice, or 64 in two chunks of 32: can't be told
    assert measured(digits, siamese, expect=True).measured
    assert measured(digits, siamese, given=True).measured



class Stacked(nn.Module):
    """The two views stacked as rows inside the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(torch.cat([x, x.flip(1)])).view(2, len(x), -1).mean(0)


def test_rows_that_outnumber_the_models_examples_are_refused(digits):
    # before: views stacked as rows read B_simple 43.1 (95% CI 39.2-47.8) over 150 steps against an exact 86.4
    stacked = measured(digits, lambda model, x: model(x), steps=4, model=Stacked())
    assert not stacked.measured
    assert "64 rows, but the model was called on 32 examples" in stacked.failure
    assert measured(digits, lambda m, x: m(x)).measured  # one row per example: as before


class SharedDepth(nn.Module):
    """One hidden layer applied twice in the model's own forward (weights shared across depth)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.hidden, self.head = nn.Linear(64, 32), nn.Linear(32, 32), nn.Linear(32, 10)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(torch.tanh(self.hidden(torch.tanh(self.hidden(h)))))


def test_a_layer_called_twice_in_the_models_one_forward_needs_no_batch_size(digits):
    """The model's own forward ran once, on 32 examples, and each call of the shared layer ran on those 32 rows: they
    are the same examples, and the run reads as with the size given (before: refused, asking for the size)."""
    unsized, sized = (measured(digits, lambda model, x: model(x), expect=expect, model=SharedDepth())
                      for expect in (False, True))
    assert unsized.measured and sized.measured
    assert unsized.b_simple == sized.b_simple
