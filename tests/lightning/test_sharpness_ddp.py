"""SharpnessMonitor under DDP for real (2 CPU processes, gloo, ddp_spawn): each rank measures its own batch and
both keep the maximum over ranks."""

import json

import pytest
import pytorch_lightning as pl
import torch.nn.functional as F

from gns_callback.curvature import sharpness
from gns_callback.lightning.sharpness import SharpnessMonitor
from tests.helpers import Classifier, mlp, quiet_trainer

pytestmark = pytest.mark.usefixtures("file_system_sharing")


class MeasureAndCheck(pl.Callback):
    """Runs the monitor, and next to it this rank's own converged λ_max of the same batch; writes both."""

    def __init__(self, directory):
        self.directory = directory
        self.monitor = SharpnessMonitor(steps=(1, 3), max_iterations=200, rtol=1e-9)
        self.local = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        count = len(self.monitor.measurements)
        self.monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if len(self.monitor.measurements) > count:
            x, y = batch
            self.local[trainer.global_step] = sharpness(lambda: F.cross_entropy(pl_module(x), y),
                                                        list(pl_module.parameters()), max_iterations=500, rtol=1e-9)

    def on_fit_end(self, trainer, pl_module):
        with open(f"{self.directory}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"measurements": self.monitor.measurements, "local": self.local,
                       "largest": self.monitor.largest}, f)


def test_ranks_keep_the_maximum_over_their_batches(digits, tmp_path):
    x, y = digits
    module = Classifier(mlp(hidden=16), lr=0.5, loader_args=dict(x=x, y=y, batch_size=16, num_samples=16 * 5))
    trainer = quiet_trainer(strategy="ddp_spawn", devices=2, max_steps=5, use_distributed_sampler=False,
                            callbacks=[MeasureAndCheck(str(tmp_path))])
    trainer.fit(module)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["measurements"] == ranks[1]["measurements"]
    assert [s for s, _ in ranks[0]["measurements"]] == [1, 3]
    for step, value in ranks[0]["measurements"]:
        local = [r["local"][str(step)] for r in ranks]
        assert local[0] != pytest.approx(local[1], rel=1e-3)  # different batches: the max is a real choice
        assert value == pytest.approx(max(local), rel=1e-4)
    assert ranks[0]["largest"] == ranks[1]["largest"] == max(v for _, v in ranks[0]["measurements"])
