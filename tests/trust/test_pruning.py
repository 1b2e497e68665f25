"""Pruning during the run (Lightning's ``ModelPruning``, ``torch.nn.utils.prune``) moves a layer's weight off it:
the Parameter becomes ``weight_orig`` and the layer runs on ``weight_orig * mask``. Per-example norms taken at the
layer are then the unmasked gradients', while ``.grad`` holds the masked one. Before this check nothing noticed: on
digits with the layers pruned after the first epoch the run read B_simple = inf with |G|² < 0, without a warning."""

import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelPruning

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, quiet_trainer, with_replacement_loader
from tests.trust.setups import assert_withheld


def fit_pruned_after_first_epoch(digits, accumulate):
    x, y = digits
    callback = GradientNoiseScaleCallback(verbose=False, recommend=False)
    pruning = ModelPruning("l1_unstructured", amount=0.7, apply_pruning=lambda epoch: epoch == 0,
                           make_pruning_permanent=False, verbose=0)
    module = Classifier(mlp())
    trainer = quiet_trainer(max_epochs=3, accumulate_grad_batches=accumulate, callbacks=[callback, pruning])
    trainer.fit(module, with_replacement_loader(x, y, 16, 16 * 400, seed=0))
    return callback, module


def test_pruning_mid_run_stops_per_example_norms_with_the_fix(digits):
    callback, module = fit_pruned_after_first_epoch(digits, accumulate=1)
    assert any(name.endswith("weight_orig") for name, _ in module.net.named_parameters())  # pruned, kept so
    assert_withheld(callback.run_estimate, "pruned", "method='micro_batch'")


def test_pruning_mid_run_switches_to_micro_batch_where_it_can(digits, exact_gns):
    """With two micro-batches per step ``auto`` switches; the estimate restarts on the pruned model."""
    callback, module = fit_pruned_after_first_epoch(digits, accumulate=2)
    assert callback.meter.method == "micro_batch" and callback.meter.switched_from == "per_example"
    x, y = digits
    assert_matches_exact(callback.run_estimate, exact_gns(module.net, F.cross_entropy, x, y)[0], max_ci_ratio=3.0)
