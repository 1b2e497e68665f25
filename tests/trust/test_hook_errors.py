"""An error inside the per-example hooks never ends the user's run. Such an error is a bug of ours (two were found
on Hugging Face's PoolFormer and ProphetNet: a negative dim or index saved by torch as its unsigned value), and it
used to raise inside the user's ``loss.backward()``. Now the hook stops the measurement with the error as its reason,
warns once, and the run trains exactly as it would without the callback."""

from __future__ import annotations

import warnings
from itertools import count

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gns_callback import GradientNoiseScaleCallback, GradientNoiseScaleMeter
from gns_callback.per_example.tracker import SUPPORTED_MODULES, PerExampleNormTracker
from tests.helpers import Classifier, mlp, quiet_trainer, with_replacement_loader
from tests.trust.setups import assert_withheld, messages, single

STEPS, FAILS_FROM = 30, 12


@pytest.fixture
def linear_norms_fail_mid_run(monkeypatch):
    """From step :data:`FAILS_FROM` on, the Linear layers' norms raise (the MLP has two Linear layers)."""
    calls, real = count(), SUPPORTED_MODULES[nn.Linear]

    def failing(*args, **kwargs):
        if next(calls) >= 2 * (FAILS_FROM - 1):
            raise IndexError("injected")
        return real(*args, **kwargs)

    monkeypatch.setitem(SUPPORTED_MODULES, nn.Linear, failing)


def fit(x, y, callbacks):
    module = Classifier(mlp(), lr=0.1)
    trainer = quiet_trainer(callbacks=callbacks, max_epochs=1)
    trainer.fit(module, with_replacement_loader(x, y, 32, 32 * STEPS, seed=0))
    assert trainer.global_step == STEPS
    return {k: v.clone() for k, v in module.state_dict().items()}


def fits_unchanged(digits, callback, without) -> list:
    """A fit with ``callback`` ends with the weights ``without`` it, to the bit; the warnings it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        with_callback = fit(*digits, [callback])
    assert all(torch.equal(without[k], with_callback[k]) for k in without)
    return caught


@pytest.fixture
def without(digits):
    """The weights of the fit without the callback."""
    torch.manual_seed(0)
    return fit(*digits, [])


def test_a_lightning_fit_goes_on_unchanged_and_says_why_it_stopped_measuring(digits, without,
                                                                             linear_norms_fail_mid_run):
    callback = GradientNoiseScaleCallback(verbose=False)
    caught = fits_unchanged(digits, callback, without)
    stopped = single(messages(caught, "stopped measuring"))
    assert "IndexError: injected" in stopped and "a bug in gns_callback" in stopped
    assert_withheld(callback.estimate, "IndexError: injected")
    assert callback.meter.steps_seen > 1  # it failed mid-run, after measured steps


def test_in_your_own_loop_backward_and_step_do_not_raise(digits, linear_norms_fail_mid_run):
    x, y = digits
    model = mlp()
    batches = torch.randint(0, len(x), (STEPS, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientNoiseScaleMeter(model) as meter:
            for index in batches:
                model.zero_grad()
                F.cross_entropy(model(x[index]), y[index]).backward()
                meter.step()
    single(messages(caught, "stopped measuring"))
    assert_withheld(meter.estimate, "IndexError: injected")


def test_an_error_reading_the_step_s_norms_stops_measuring_and_leaves_the_run_as_it_was(digits, without, monkeypatch):
    calls, real = count(), PerExampleNormTracker.pop_passes

    def failing(self):
        if next(calls) >= FAILS_FROM:
            raise ValueError("injected")
        return real(self)

    monkeypatch.setattr(PerExampleNormTracker, "pop_passes", failing)
    callback = GradientNoiseScaleCallback(verbose=False)
    caught = fits_unchanged(digits, callback, without)
    assert "ValueError: injected" in single(messages(caught, "stopped measuring"))
    assert_withheld(callback.estimate, "a bug in gns_callback")
