"""Lightning's tuner runs short trial fits before the real one (``Tuner.lr_find`` and ``Tuner.scale_batch_size``, or
their callbacks ``LearningRateFinder`` and ``BatchSizeFinder``), each with its own learning rates or batch sizes, then
puts the model back. Their steps are not the run's: the estimate holds the real fit's steps only and matches the
exact value at the parameters the fit runs at (``lr=0`` there, so they stay fixed), whether the tuner runs before
``fit`` or inside it."""

import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import BatchSizeFinder, LearningRateFinder
from pytorch_lightning.tuner import Tuner

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, mlp, quiet_trainer, with_replacement_loader

STEPS = 200


class Tunable(Classifier):
    """The tuner reads and writes ``batch_size`` and ``learning_rate``; the fit after it runs at ``lr=0``."""

    def __init__(self, x, y):
        super().__init__(mlp())
        self.x, self.y, self.batch_size, self.learning_rate = x, y, 32, 0.0

    def train_dataloader(self):
        return with_replacement_loader(self.x, self.y, self.batch_size, self.batch_size * STEPS, seed=0)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)


def tune_then_fit(digits, tuner: str, default_root_dir):
    callback = GradientNoiseScaleCallback(verbose=False, recommend=False)
    finders = {"lr_callback": [LearningRateFinder(num_training_steps=30, update_attr=False)],
               "batch_size_callback": [BatchSizeFinder(init_val=16, max_trials=2, steps_per_trial=5)]}
    trainer = quiet_trainer(callbacks=[callback, *finders.get(tuner, [])], default_root_dir=str(default_root_dir))
    module = Tunable(*digits)
    if tuner == "lr_find":
        Tuner(trainer).lr_find(module, num_training=30, update_attr=False)
    if tuner == "scale_batch_size":
        Tuner(trainer).scale_batch_size(module, init_val=16, max_trials=2, steps_per_trial=5)
    trainer.fit(module)
    return callback, module


@pytest.mark.parametrize("tuner", ["lr_find", "scale_batch_size", "lr_callback", "batch_size_callback"])
def test_the_tuners_trial_steps_are_not_measured(digits, exact_gns, tmp_path, tuner):
    callback, module = tune_then_fit(digits, tuner, tmp_path)
    assert callback.run_estimate.steps == STEPS  # the trial fits' 30 or 2 × 5 steps are not in it
    exact = exact_gns(module.net, F.cross_entropy, *digits)[0]
    assert exact == pytest.approx(exact_gns(mlp(), F.cross_entropy, *digits)[0])  # the tuner put the model back
    assert_matches_exact(callback.run_estimate, exact)
