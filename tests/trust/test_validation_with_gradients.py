"""Issue 10 item 3: validation that needs gradients (``Trainer(inference_mode=False)`` and ``torch.autograd.grad`` in
``validation_step``). The per-example hooks stayed on during validation: 107.6 [62, 285] against an exact 32.6
with a validation batch of 16, a crash with 32. The hooks are now inert from validation start to end (the sanity
check included), and what a step recorded before a validation in the middle of its accumulation window is kept."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, with_replacement_loader
from tests.trust.setups import with_and_without

STEPS = 150


class GradientsInValidation(Classifier):
    def __init__(self, net, val_batch_size):
        super().__init__(net)
        self.val_batch_size = val_batch_size

    def validation_step(self, batch, batch_idx):
        x, y = batch
        with torch.enable_grad():  # Lightning validates under no_grad (inference_mode=False lets this work)
            x = x.clone().requires_grad_(True)
            (saliency,) = torch.autograd.grad(F.cross_entropy(self.net(x), y), x)
        self.log("val_saliency", saliency.abs().mean(), batch_size=len(x))


@pytest.mark.parametrize("method, accumulate, batch_size, val_batch_size",
                         [("per_example", 1, 32, 16), ("per_example", 1, 32, 32), ("micro_batch", 4, 8, 32)])
def test_validation_with_gradients_is_not_measured(digits, exact_gns, method, accumulate, batch_size, val_batch_size):
    x, y = digits
    settings = dict(inference_mode=False, accumulate_grad_batches=accumulate, val_check_interval=10,
                    limit_val_batches=2)  # every 10 micro-batches: inside accumulation windows of 4 too
    loaders = lambda: {  # noqa: E731
        "train_dataloaders": with_replacement_loader(x, y, batch_size, batch_size * accumulate * STEPS, seed=0),
        "val_dataloaders": DataLoader(TensorDataset(x[:128], y[:128]), batch_size=val_batch_size),
    }
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    trainer, _ = with_and_without(lambda: GradientsInValidation(mlp(), val_batch_size), loaders, callback, **settings)
    assert trainer.callback_metrics["val_saliency"] > 0  # validation really ran autograd.grad
    assert callback.run_estimate.steps == STEPS and callback.run_estimate.method == method
    assert_matches_exact(callback.run_estimate, exact_gns(mlp(), F.cross_entropy, x, y)[0])
