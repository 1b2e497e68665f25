"""Issue 10 item 4: a gradient penalty (``torch.autograd.grad(..., create_graph=True)`` inside ``training_step``).
The per-example hooks fired in that pass too (|G|² = −156, B_simple = inf). Only the backward pass that produces
the step's ``.grad`` is measured now; and since the penalty's second-order term enters ``.grad`` through paths no
layer hook sees, ``per_example`` can't measure such a loss: ``auto`` switches to ``micro_batch`` (which sees whole
gradients) where the run has several micro-batches, and otherwise the estimate is withheld with the reason."""

import pytest
import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, with_replacement_loader
from tests.trust.models import GradientPenaltyClassifier, exact_b_simple_of_loss, penalised_loss_of_one
from tests.trust.setups import assert_withheld, messages, single, with_and_without

STEPS = 150


@pytest.fixture(scope="module")
def penalised_exact(digits):
    return exact_b_simple_of_loss(penalised_loss_of_one(mlp()), mlp(), *digits)[0]


def run(digits, module_class, method, accumulate, batch_size, steps=STEPS):
    x, y = digits
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    _, caught = with_and_without(
        lambda: module_class(mlp()),
        lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * steps, seed=0),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught


def test_auto_switches_to_micro_batch(digits, penalised_exact):
    """After the switch, micro_batch measures the penalised loss exactly (it did so before, too: 21.6 vs 21.6)."""
    callback, caught = run(digits, GradientPenaltyClassifier, "auto", 4, 8)
    assert "create_graph=True" in single(messages(caught, "switched from method='per_example' to 'micro_batch'"))
    assert callback.run_estimate.method == "micro_batch" and callback.run_estimate.steps == STEPS - 1
    assert_matches_exact(callback.run_estimate, penalised_exact)


def test_per_example_with_one_micro_batch_withholds(digits):
    callback, caught = run(digits, GradientPenaltyClassifier, "auto", 1, 32, steps=10)
    assert_withheld(callback.run_estimate, "create_graph=True", "method='micro_batch'")
    single(messages(caught, "stopped measuring"))


class InputGradientForLogging(Classifier):
    """``torch.autograd.grad`` without ``create_graph`` (a saliency for logging): it does not enter ``.grad``."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        x = x.clone().requires_grad_(True)
        loss = F.cross_entropy(self.net(x), y)
        (saliency,) = torch.autograd.grad(loss, x, retain_graph=True)
        self.saliency = saliency.abs().mean().item()
        return loss


def test_autograd_grad_passes_that_leave_grad_alone_are_ignored(digits, exact_gns):
    """The extra pass reaches every hooked layer, but only the pass that fills ``.grad`` is measured."""
    callback, _ = run(digits, InputGradientForLogging, "per_example", 1, 32)
    assert callback.run_estimate.method == "per_example" and callback.run_estimate.steps == STEPS
    assert_matches_exact(callback.run_estimate, exact_gns(mlp(), F.cross_entropy, *digits)[0])
