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
