"""Issue 10 item 5: a ``torch.func`` transform over the model while the hooks are attached (per-example gradients
with ``vmap(grad(...))`` in a hook of the user's own) crashed with "attempted to call in-place operation ... that
would mutate a captured Tensor". The hooks are inert inside ``torch.func`` transforms: only the training step's own
forward and backward are measured."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, with_replacement_loader
from tests.trust.setups import with_and_without

STEPS = 150


class PerExampleGradientNorms(pl.Callback):
    """The user's own hook: per-example gradient norms of the first 4 examples of each batch, via torch.func."""

    def __init__(self):
        self.norms = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, y = batch
        net = pl_module.net
        params = {name: p.detach() for name, p in net.named_parameters()}

        def loss(p, xi, yi):
            return F.cross_entropy(functional_call(net, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

        grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[:4], y[:4])
        self.norms.append(torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1))


@pytest.mark.parametrize("method, accumulate, batch_size", [("per_example", 1, 32), ("micro_batch", 4, 8)])
def test_torch_func_in_a_users_hook(digits, exact_gns, method, accumulate, batch_size):
    x, y = digits
    users = PerExampleGradientNorms()
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    with_and_without(lambda: Classifier(mlp()),
                     lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * STEPS, seed=0),
                     callback, accumulate_grad_batches=accumulate, callbacks=[users])
    assert len(users.norms) > accumulate * STEPS  # the user's transform ran at every batch (of both fits)
    assert callback.run_estimate.steps == STEPS
    assert_matches_exact(callback.run_estimate, exact_gns(mlp(), F.cross_entropy, x, y)[0])
