"""The meter's checks that per-example norms measure this model and loss
(:meth:`~gns_callback.meter.GradientNoiseScaleMeter.check_batch`), run on the fit's first batch with
``training_step`` as the loss (the batch's copies are made before it: mixup there is seen): full precision (no
autocast), ``self.log`` silenced, SyncBatchNorm local, no DDP gradient sync, and everything the passes touch put
back. Two or three forward and backward passes, once per fit."""

from __future__ import annotations

from typing import Any

import torch

from gns_callback.lightning.trainer_facts import compiled_whole
from gns_callback.meter import GradientNoiseScaleMeter
from gns_callback.per_example.checks import PerExampleCheck
from gns_callback.probe.lightning import ddp_no_sync, lightning_step, module_internals, silenced_logging
from gns_callback.probe.state import local_batch_norm


def check_first_batch(meter: GradientNoiseScaleMeter, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                      batch_size: int) -> PerExampleCheck:
    """Run the check on ``batch`` (on every rank: each checks its own batch, and the meter's next step agrees).
    ``micro_batch``'s check of the loss's divisor is left out where Lightning compiles the module itself: its pass
    would compile the step a second time."""
    if meter.method == "micro_batch" and compiled_whole(pl_module):
        return meter.per_example_check or PerExampleCheck("not checked", detail="a compiled module")
    with silenced_logging(pl_module), local_batch_norm(pl_module), ddp_no_sync(trainer), torch.enable_grad():
        return meter.check_batch(lightning_step(pl_module, None, batch_idx), batch, batch_size,
                                 keep=[trainer, *trainer.optimizers], skip=module_internals())
