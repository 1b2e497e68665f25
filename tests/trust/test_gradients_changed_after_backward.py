"""Gradient clipping or zeroing in ``on_after_backward`` (gns_callback/grad_watch.py), in real fits.

The small-batch norms are taken during backward, ``|G_B|²`` at the optimizer step: clipping in between mixed a
clipped ``|G_B|²`` with unclipped norms. On the digits MLP, clipping at 0.6 read B_simple = 87.8 (95% CI 78.9–99.0)
against an exact 68.0, a confident wrong number; at 0.45, ``inf``. Then the callback stopped at the first step that
clipped, with the fix. Now (one process) it reads ``|G_B|²`` as kept at the end of backward, where the norms were
taken, and measures as without the change; under DDP a change still stops it (``tests/trust/
test_loop_changes_gradients.py``).

The other way ``.grad`` went wrong before the read: a backbone left trainable while only the head is optimized.
``zero_grad`` clears only the optimizer's parameters, so the backbone's ``.grad`` grew from step to step and the
run read B_simple = 0.0. Now the first step notices and the measurement stops, with the fix.
"""

import pytest
import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, mlp, with_replacement_loader
from tests.trust.setups import assert_withheld, messages, single, with_and_without

STEPS = 40


class ClipsAfterBackward(Classifier):
    def on_after_backward(self):
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.6)


class FreezesUnitsAfterBackward(Classifier):
    """Zeroes half of the first layer's weight gradient: a change the watched small parameters never see. In a plain
    loop at fixed parameters this read B_simple = 773 (95% CI 390–33,600) against an exact 68."""

    def on_after_backward(self):
        self.net[0].weight.grad[:16] = 0


class LogsGradientNorms(Classifier):
    """Reads the gradients after backward without changing them: nothing to stop for."""

    def on_after_backward(self):
        self.norms = getattr(self, "norms", []) + [float(torch.nn.utils.get_total_norm(
            [p.grad for p in self.parameters()]))]


def fit(digits, make_module, method: str = "auto", accumulate: int = 1, batch_size: int = 32):
    """The setup trains without the callback, then with it for ``STEPS`` steps; the callback and its warnings."""
    x, y = digits
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    trainer, caught = with_and_without(
        make_module, lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * STEPS, seed=0),
        callback, accumulate_grad_batches=accumulate)
    assert trainer.global_step == STEPS
    return callback, caught


def assert_stopped(callback, caught, *phrases: str) -> None:
    single(messages(caught, "stopped measuring"))
    assert_withheld(callback.run_estimate, *phrases)


def assert_measured(callback) -> None:
    assert callback.run_estimate.steps == STEPS and callback.meter.failure is None


@pytest.mark.parametrize("module", [ClipsAfterBackward, FreezesUnitsAfterBackward])
def test_gradients_changed_in_on_after_backward_are_read_as_backward_left_them(digits, exact_gns, module):
    """One backward pass per step, at fixed parameters so that the exact value is known: the read takes |G_B|² as
    kept at the end of backward, where the per-example norms were taken, and holds the exact value."""
    x, y = digits
    exact = exact_gns(mlp(), F.cross_entropy, x, y)[0]
    callback, caught = fit(digits, lambda: module(mlp(), lr=0.0))
    assert_measured(callback)
    assert not messages(caught, "stopped measuring")
    assert callback.run_estimate.ci_low <= exact <= callback.run_estimate.ci_high


@pytest.mark.parametrize("module, phrase", [(ClipsAfterBackward, "gradient_clip_val"),
                                            (FreezesUnitsAfterBackward, "on_before_optimizer_step")])
def test_gradients_changed_between_accumulated_passes_stop_measuring_with_the_fix(digits, module, phrase):
    """With several backward passes a step, a change after one of them is in the gradients the next ones add to:
    no mark holds the step's |G_B|² as its passes made it."""
    callback, caught = fit(digits, lambda: module(mlp(), lr=0.1), "micro_batch", 4, 8)
    assert_stopped(callback, caught, "on_after_backward", phrase)

def test_reading_the_gradients_after_backward_is_measured(digits):
    assert_measured(fit(digits, lambda: LogsGradientNorms(mlp()))[0])


class HeadOnly(Classifier):
    """Optimizes the last layer only; the first stays trainable (a common slip when fine-tuning)."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.net[-1].parameters(), lr=0.1)


class WithTeacher(Classifier):
    """A trainable copy no optimizer holds that gets no gradient (an EMA teacher run under no_grad): harmless."""

    def __init__(self, net):
        super().__init__(net, lr=0.1)
        self.teacher = mlp(seed=1)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            self.teacher(batch[0])
        return super().training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


def test_a_trainable_layer_no_optimizer_holds_stops_measuring_with_the_fix(digits):
    assert_stopped(*fit(digits, lambda: HeadOnly(mlp())), "'net.0.weight'", "requires_grad_(False)")


def test_a_trainable_copy_without_gradients_is_no_problem(digits):
    assert_measured(fit(digits, lambda: WithTeacher(mlp()))[0])
