"""The meter's checks that per-example norms measure this model and loss
(:meth:`~gns_callback.meter.GradientNoiseScaleMeter.check_per_example`), run on the fit's first batch
with ``training_step`` as the pass: full precision (no autocast), ``self.log`` silenced, SyncBatchNorm local, no
DDP gradient sync, and everything the passes touch put back. Two or three forward and backward passes, once per
fit."""

from __future__ import annotations

from typing import Any

import torch

from gns_callback.batch_size import first_half_copied
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
    step = lightning_step(pl_module, None, batch_idx)
    # A copy of the batch on its device, only where per-example norms are checked at all.
    copied, any_copied = first_half_copied(batch, batch_size) if meter.method == "per_example" else (None, False)
    from_row = first_half_copied(batch, batch_size, from_first_row=True)[0] if any_copied else None

    def run_pass() -> None:
        step(batch).backward()

    def run_replaced_pass() -> None:  # rows copied before training_step: mixup there is seen
        step(copied).backward()

    def run_first_row_pass() -> None:  # a statistic of the labels the first copy left as it was is seen
        step(from_row).backward()

    with silenced_logging(pl_module), local_batch_norm(pl_module), ddp_no_sync(trainer), torch.enable_grad():
        return meter.check_per_example(run_pass, batch_size, run_replaced_pass if any_copied else None,
                                       run_first_row_pass if any_copied else None,
                                       keep=[trainer, *trainer.optimizers], skip=module_internals())
