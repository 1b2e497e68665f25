"""``GradientNoiseScaleMeter`` in plain loops written as a newcomer writes them from the README, against exact values
(``benchmarks/plain_loops.py`` surveys more of them)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_wine
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gns_callback import GradientNoiseScaleMeter


@pytest.fixture(scope="module")
def wine():
    """scikit-learn's wine (178 examples), standardised: small enough that drawing without replacement matters."""
    data = load_wine()
    x = torch.tensor(data.data, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), torch.tensor(data.target)


def wine_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(13, 32), nn.Tanh(), nn.Linear(32, 3))


def epochs_over(loader: DataLoader, model: nn.Module, meter: GradientNoiseScaleMeter, steps: int) -> None:
    """The README's loop over a DataLoader, epoch after epoch, at lr 0 (fixed parameters)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    done = 0
    while done < steps:
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            meter.step()
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                return


def test_a_shuffled_loader_left_out_of_population_is_found_and_its_interval_holds(wine, exact_gns):
    """DataLoader(shuffle=True) over wine, no population= given: the meter took the batches as drawn with
    replacement and read 4.4 [4.3, 4.5] against an exact 4.2, with nothing said. Now the first step finds the loader
    in the loop, warns with the fix, corrects for its 178 examples and keeps the uncorrected upper end."""
    x, y = wine
    model = wine_mlp()
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught, GradientNoiseScaleMeter(model) as meter:
        warnings.simplefilter("always")
        epochs_over(loader, model, meter, steps=300)
    said = [str(w.message) for w in caught if "population" in str(w.message)]
    assert len(said) == 1 and "`loader`" in said[0] and "population=loader" in said[0], said
    estimate = meter.run_estimate
    exact = exact_gns(wine_mlp(), F.cross_entropy, x, y)[0]
    assert estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_loader_given_as_population_or_drawn_with_replacement_says_nothing(wine, shuffle):
    x, y = wine
    model = wine_mlp()
    if shuffle:
        loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    else:
        with_replacement = torch.utils.data.RandomSampler(range(len(x)), replacement=True, num_samples=320)
        loader = DataLoader(TensorDataset(x, y), batch_size=32, sampler=with_replacement)
    with warnings.catch_warnings(), GradientNoiseScaleMeter(model, population=loader if shuffle else None) as meter:
        warnings.simplefilter("error")
        epochs_over(loader, model, meter, steps=10)
    assert meter.population == (178 if shuffle else None)


def amp_accumulation(model: nn.Module, x, y, meter: GradientNoiseScaleMeter, clip_first: bool, steps: int) -> None:
    """PyTorch's AMP recipe over 4 accumulated micro-batches of 8 (each loss / 4) at lr 0: scale, backward, unscale_,
    clip_grad_norm_ (before or after ``meter.step``), scaler.step, scaler.update."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    draws = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _ in range(4):
            i = torch.randint(0, len(x), (8,), generator=draws)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x[i]), y[i]) / 4
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if clip_first:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        meter.step(micro_batch_size=8, loss_scale=scaler.get_scale())
        if not clip_first:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


@pytest.mark.parametrize("method", ["micro_batch", "per_example"])
def test_amp_accumulation_clipped_before_the_meter_says_where_to_call_it(digits, exact_gns, method):
    """Clipping after accumulated passes, before ``meter.step(loss_scale=)``, is refused (|G_B|² as backward left it
    can't be read over several passes). The reason said to pass loss_scale=, which this loop did, and how to order
    unscale_; it now says the step ran 4 passes and to call meter.step() before clip_grad_norm_. So ordered, the
    loop is measured."""
    x, y = digits
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    with warnings.catch_warnings(), GradientNoiseScaleMeter(model, method=method) as refused:
        warnings.simplefilter("ignore")
        amp_accumulation(model, x, y, refused, clip_first=True, steps=3)
    failure = refused.run_estimate.failure
    assert failure and "4 backward passes" in failure and "before clip_grad_norm_" in failure, failure
    with warnings.catch_warnings(), GradientNoiseScaleMeter(model, method=method) as meter:
        warnings.simplefilter("error")
        amp_accumulation(model, x, y, meter, clip_first=False, steps=100)
    estimate, exact = meter.run_estimate, exact_gns(model, F.cross_entropy, x, y)[0]
    assert estimate.steps == 100 and estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact)


@pytest.mark.parametrize("given", [4, 8])
def test_a_micro_batch_size_the_models_input_does_not_show_is_said_with_the_fix(digits, given):
    """4 passes of 8 with ``method="micro_batch"``, each told 4 examples: B_simple read 32.8 (95% CI 28.9–37.7)
    against an exact 68.0 with nothing said. Where the size given is neither dim 0 nor dim 1 of the model's input,
    one warning now names the size each forward pass took; told 8, nothing is said."""
    x, y = digits
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    draws = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, GradientNoiseScaleMeter(model, method="micro_batch") as meter:
        warnings.simplefilter("always")
        for _ in range(5):
            for _ in range(4):
                i = torch.randint(0, len(x), (8,), generator=draws)
                (F.cross_entropy(model(x[i]), y[i]) / 4).backward()
            meter.step(micro_batch_size=given)
            model.zero_grad()
    said = [str(w.message) for w in caught]
    if given == 8:
        assert not said, said
    else:
        assert len(said) == 1 and "micro_batch_size=4" in said[0] and "meter.step(micro_batch_size=8)" in said[0], said


@pytest.mark.parametrize("kind, loop", [("dropout", "plain"), ("mlp", "fp16")])
def test_the_loop_trains_bit_for_bit_as_without_the_meter(kind, loop):
    """Weights, momentum, torch's, Python's and numpy's random states and the data order after 20 steps of a loop that
    trains (the plain one with check_batch and the loader found in its scope; fp16 with a GradScaler and clipping)."""
    import numpy as np

    from benchmarks.plain_loops import trained

    without, with_meter = trained(kind, loop, False, steps=20), trained(kind, loop, True, steps=20)
    assert all(torch.equal(a, b) for a, b in zip(without[:3], with_meter[:3]))
    assert without[3] == with_meter[3] and np.array_equal(without[4], with_meter[4])
    assert torch.equal(without[5], with_meter[5])


class TimeFirstOutput(nn.Module):
    """Batch-first ``(B, 8, 8)`` rows in (the digits' image rows as 8 steps), time-first ``(8, B, 10)`` out: the
    layout CTC's ``log_probs`` take."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.head = nn.Linear(8, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x))).transpose(0, 1)


def test_a_time_first_output_of_batch_first_inputs_is_measured(digits, exact_gns):
    """A plain loop, the size told nowhere, over a model whose layers run on the batch's rows and whose output is
    time-first, ``(T, B, C)`` with ``T = 8 < B``: its examples sit in dim 1, not a disjoint union pooled to fewer
    rows. Before, it was stopped at the first step ("the model returned 8"); now measured, the exact value inside."""
    x, y = digits
    x = x.reshape(-1, 8, 8)

    def loss_fn(out, target):
        return F.cross_entropy(out.mean(0), target)

    model, generator = TimeFirstOutput(), torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with GradientNoiseScaleMeter(model, method="per_example") as meter:
            for _ in range(60):
                index = torch.randint(0, len(x), (128,), generator=generator)
                loss_fn(model(x[index]), y[index]).backward()
                meter.step()
                model.zero_grad()
    estimate, exact = meter.run_estimate, exact_gns(TimeFirstOutput(), loss_fn, x, y)[0]
    assert estimate.measured and estimate.steps == 60, estimate.failure
    assert estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact)
