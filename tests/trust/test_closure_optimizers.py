"""Optimizers that evaluate their closure several times per step (``torch.optim.LBFGS``).

Lightning calls ``on_before_optimizer_step`` after every evaluation of the closure, so each of LBFGS's inner
evaluations was measured as a step of its own: up to ``max_iter`` readings per optimizer step, all on the same batch.
After the first, the parameters have been fitted to that batch by the line search, so its ``|G_B|²`` is far below the
population's and B_simple read ever larger: on the wine MLP 13-16-3 (LBFGS lr 0.1, max_iter 5, batch 16, 120 steps),
35,500 from 560 readings, where SGD with Nesterov momentum reads 16. Now only the first evaluation of each optimizer
step is measured, where the parameters do not yet depend on the batch: 18.8 from 120.
"""

import torch

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, mlp, with_replacement_loader
from tests.trust.setups import fit

STEPS = 30


class WithLBFGS(Classifier):
    def __init__(self, lr: float, still: bool = False) -> None:
        super().__init__(mlp(), lr=lr)
        self.still = still

    def configure_optimizers(self):
        # still: every inner iteration runs (no tolerance stops it), on unchanged parameters at lr 0
        tolerances = {"tolerance_grad": -1.0, "tolerance_change": -1.0} if self.still else {}
        return torch.optim.LBFGS(self.parameters(), lr=self.lr, max_iter=4, **tolerances)


def measured(digits, module) -> GradientNoiseScaleCallback:
    x, y = digits
    callback = GradientNoiseScaleCallback(method="per_example", sharpness=False, verbose=False)
    trainer = fit(module, with_replacement_loader(x, y, 32, 32 * STEPS, seed=0), (callback,))
    assert trainer.global_step == STEPS
    return callback


def test_only_the_first_closure_evaluation_of_each_step_is_measured(digits):
    """At lr 0 every evaluation sees the same parameters, so LBFGS must read exactly what SGD reads on the same
    batches: each step's batch counted once (four copies of it narrowed the interval as if it were four batches)."""
    lbfgs = measured(digits, WithLBFGS(lr=0.0, still=True)).run_estimate
    sgd = measured(digits, Classifier(mlp(), lr=0.0)).run_estimate
    assert lbfgs.steps == sgd.steps == STEPS
    for field in ("b_simple", "ci_low", "ci_high"):
        assert abs(getattr(lbfgs, field) - getattr(sgd, field)) <= 1e-4 * getattr(sgd, field), field


def test_a_training_lbfgs_run_is_measured_once_per_step(digits):
    callback = measured(digits, WithLBFGS(lr=0.5))
    assert callback.run_estimate.steps == STEPS and callback.meter.failure is None
