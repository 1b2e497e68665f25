"""A module's ``optimizer_step`` that skips the step on some batches by running the closure alone (Lightning's own
docstring shows it, for alternating updates): that batch's backward pass runs, and its gradient is zeroed before the
next batch's. The next step must be read from its own passes only. Before, the skipped pass was read as a micro-batch
of the next step, whose gradient holds one: skipping one step in 4 on the digits MLP read B_simple = 117 (95% CI
98–146) against an exact 67, one in 2 an unbounded interval around B_simple = inf, and with accumulation
``micro_batch`` stopped ("lists 4 sizes but 2 backward passes were measured")."""

import pytest
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, with_replacement_loader
from tests.trust.setups import fit


class SkipsSomeSteps(Classifier):
    """Every ``period``-th batch runs training_step and backward without an optimizer step."""

    def __init__(self, period: int) -> None:
        super().__init__(mlp())
        self.period = period

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        if batch_idx % self.period == self.period - 1:
            optimizer_closure()
        else:
            optimizer.step(closure=optimizer_closure)


@pytest.mark.parametrize("method, accumulate, period", [("per_example", 1, 2), ("per_example", 1, 4),
                                                       ("micro_batch", 2, 4)])
def test_a_step_skipped_by_running_the_closure_alone_is_not_read(digits, exact_gns, method, accumulate, period):
    x, y = digits
    callback = GradientNoiseScaleCallback(method=method, verbose=False, recommend=False)
    loader = with_replacement_loader(x, y, 32, 32 * 600, seed=0)
    fit(SkipsSomeSteps(period), loader, (callback,), accumulate_grad_batches=accumulate)
    estimate = callback.run_estimate
    assert estimate.failure is None, estimate.failure
    assert_matches_exact(estimate, exact_gns(mlp(), F.cross_entropy, x, y)[0])
