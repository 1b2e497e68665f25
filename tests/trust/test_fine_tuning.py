"""Fine-tuning with Lightning's ``BackboneFinetuning``: the backbone frozen for the first epoch, then unfrozen. The
callback measured the parameters trainable at its first step (the head) for the whole run: B_simple = 78.4 (95% CI
70.6–88.0, tr Σ 2.98) against the whole model's exact 68.0 (tr Σ 6.90). It now follows the unfreezing."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import BackboneFinetuning

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, mlp, quiet_trainer, with_replacement_loader

EPOCHS, STEPS_PER_EPOCH = 4, 100


class WithBackbone(Classifier):
    """The first layer is the ``backbone`` that ``BackboneFinetuning`` freezes and unfreezes (fixed parameters, lr 0,
    so that the whole run samples one distribution)."""

    def __init__(self, net):
        super().__init__(net)
        self.backbone = net[0]

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.0)


def test_an_unfrozen_backbone_is_measured_from_the_next_check_on(digits, exact_gns):
    x, y = digits
    exact, _, exact_trace = exact_gns(mlp(), F.cross_entropy, x, y)
    callback = GradientNoiseScaleCallback(verbose=False)
    unfreeze = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0,
                                  backbone_initial_ratio_lr=1.0, verbose=False)
    trainer = quiet_trainer(max_epochs=EPOCHS, limit_train_batches=STEPS_PER_EPOCH, callbacks=[callback, unfreeze])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(WithBackbone(mlp()), with_replacement_loader(x, y, 32, 32 * STEPS_PER_EPOCH * EPOCHS))
    assert len([w for w in caught if "trainable parameters changed" in str(w.message)]) == 1
    estimate = callback.run_estimate
    assert estimate.steps >= 2 * STEPS_PER_EPOCH
    assert estimate.trace_sigma == pytest.approx(exact_trace, rel=0.15)
    assert estimate.ci_low <= exact <= estimate.ci_high


class FreezesItsHead(Classifier):
    """The last layer frozen at step ``at``, between two checks of the trainable set, while the first one trains on:
    the head's output still gets a gradient, its parameters none (fixed parameters, lr 0)."""

    def __init__(self, net, at):
        super().__init__(net)
        self.at = at

    def on_train_batch_start(self, batch, batch_idx):
        if self.global_step == self.at:
            self.net[2].requires_grad_(False)


def test_a_layer_frozen_between_checks_while_an_earlier_one_trains_is_followed_at_once(digits, exact_gns):
    """Before, measuring stopped for the rest of the run ("a measured layer's output received a gradient but its
    parameters none", with micro_batch as the fix): on digits frozen at step 10 of 132, B_simple not measured."""
    x, y = digits
    callback = GradientNoiseScaleCallback(verbose=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_trainer(callbacks=[callback]).fit(FreezesItsHead(mlp(), at=10), with_replacement_loader(x, y, 32, 32 * 130))
    assert len([w for w in caught if "trainable parameters changed" in str(w.message)]) == 1
    estimate = callback.run_estimate
    assert estimate.failure is None and estimate.steps >= 110
    first_layer = mlp()
    first_layer[2].requires_grad_(False)
    exact = exact_gns(first_layer, F.cross_entropy, x, y)[0]
    assert estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact)
