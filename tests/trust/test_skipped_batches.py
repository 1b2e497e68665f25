"""A ``training_step`` that returns ``None`` skips that micro-batch: Lightning runs no backward pass for it.

The step's window must hold only the passes that ran. Before, the callback counted every micro-batch that started,
so with ``accumulate_grad_batches=2`` the first skipped one stopped ``micro_batch`` for the rest of the run ("lists 2
sizes but 1 backward passes were measured"): B_simple was not measured at all."""

import pytest
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, quiet_trainer, with_replacement_loader


class SkipsSomeBatches(Classifier):
    def training_step(self, batch, batch_idx):
        return None if batch_idx % 5 == 3 else super().training_step(batch, batch_idx)


@pytest.mark.parametrize("method, accumulate", [("micro_batch", 2), ("micro_batch", 4), ("per_example", 2)])
def test_skipped_micro_batches_leave_the_estimate_right(digits, exact_gns, method, accumulate):
    x, y = digits
    callback = GradientNoiseScaleCallback(method=method, verbose=False, recommend=False)
    loader = with_replacement_loader(x, y, 16, 16 * 1200, seed=0)
    trainer = quiet_trainer(accumulate_grad_batches=accumulate, callbacks=[callback])
    trainer.fit(SkipsSomeBatches(mlp()), loader)
    estimate = callback.run_estimate
    assert estimate.failure is None, estimate.failure
    if method == "micro_batch" and accumulate == 2:
        assert estimate.skipped_steps > 0  # the steps left with one backward pass
    assert_matches_exact(estimate, exact_gns(mlp(), F.cross_entropy, x, y)[0])
