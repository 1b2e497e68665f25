"""A model under torch.compile, in real fits (gns_callback/per_example/compiled.py).

Before: the per-example hooks never ran inside the compiled graph, so a compiled model trained its whole fit at the
callback's defaults and read "0 steps, 0 skipped" with no reason. Now a compiled submodule, or a LightningModule
handed to ``fit`` compiled, is measured with ``micro_batch`` where the run has several micro-batches (exactly: the
parameter hooks fire after the compiled backward) and refused at fit start with the fix where it has not
(tests/lightning/test_supported.py); a compiled
function inside ``training_step``, which no inspection shows, stops the per-example hooks at the first step with the
reason, and the run switches to ``micro_batch`` where it can.

``backend="aot_eager"`` compiles forward and backward through AOTAutograd as inductor does, with no C++ compiler.
"""

import pytest
import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, with_replacement_loader
from tests.trust.setups import assert_withheld, messages, single, with_and_without

BACKEND = "aot_eager"
STEPS = 150


pytestmark = pytest.mark.usefixtures("fresh_compiler")


class CompiledStep(Classifier):
    """``training_step`` runs the network through a compiled function: nothing in the module tree says so."""

    def __init__(self, net, **kwargs):
        super().__init__(net, **kwargs)
        self.run = torch.compile(lambda x: self.net(x), backend=BACKEND)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.run(x), y)


def compiled_classifier():
    return Classifier(torch.compile(mlp(), backend=BACKEND))


def loader(digits, batch_size: int, accumulate: int):
    x, y = digits
    return lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * STEPS, seed=0)


def test_a_compiled_model_is_measured_exactly_with_micro_batches(digits, exact_gns):
    callback = GradientNoiseScaleCallback(verbose=False)
    with_and_without(compiled_classifier, loader(digits, 8, 4), callback, accumulate_grad_batches=4)
    assert callback.resolved_method == "micro_batch"
    assert callback.run_estimate.steps == STEPS
    x, y = digits
    assert_matches_exact(callback.run_estimate, exact_gns(mlp(), F.cross_entropy, x, y)[0])


def test_a_compiled_function_in_training_step_stops_measuring_with_the_reason(digits):
    """One micro-batch per step: nothing to switch to. The run goes on, warned once, "not measured"."""
    callback = GradientNoiseScaleCallback(verbose=False)
    trainer, caught = with_and_without(lambda: CompiledStep(mlp(), lr=0.1), loader(digits, 32, 1), callback)
    assert trainer.global_step == STEPS
    single(messages(caught, "stopped measuring"), "one warning")
    assert_withheld(callback.estimate, "torch.compile", "method='micro_batch'")


def test_a_compiled_function_in_training_step_switches_to_micro_batch(digits, exact_gns):
    callback = GradientNoiseScaleCallback(verbose=False)
    _, caught = with_and_without(lambda: CompiledStep(mlp()), loader(digits, 8, 4), callback,
                                 accumulate_grad_batches=4)
    assert "torch.compile" in single(messages(caught, "switched from method='per_example' to 'micro_batch'"))
    assert callback.meter.method == "micro_batch" and callback.run_estimate.steps == STEPS - 1
    x, y = digits
    assert_matches_exact(callback.run_estimate, exact_gns(mlp(), F.cross_entropy, x, y)[0])
