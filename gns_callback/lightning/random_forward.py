"""Whether ``training_step`` draws random numbers of its own (``F.dropout``, stochastic depth, noise injection,
random masking), which no module type shows: two forward passes on the fit's first batch, the second from the
random state the first left, everything put back afterwards (:func:`gns_callback.probe.lightning.aside_from_the_run`:
the random streams included). Different losses mean an example's gradient varies from one draw to the next
(:mod:`gns_callback.sampling`). Two forward passes without gradients, once per fit."""

from __future__ import annotations

from typing import Any, Optional

import torch

from gns_callback.probe.lightning import aside_from_the_run, lightning_step

#: Losses this close are the same: an accelerator's kernels may sum in another order from one pass to the next
#: (about 1e-7 of a float32 loss), while a dropout mask moves it by far more.
SAME_LOSS = 1e-6
DRAWS_RANDOM = ("training_step drew random numbers on the first batch (two forward passes from different random "
                "states read different losses: dropout by function, stochastic depth, noise or random masks)")


def forward_draws_randomness(trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> Optional[str]:
    """:data:`DRAWS_RANDOM` where the two losses differ (or the passes could not run: then the draws are not
    shown fixed), else None."""
    step = lightning_step(pl_module, None, batch_idx)
    try:
        with aside_from_the_run(trainer, pl_module), torch.no_grad():
            first, second = step(batch), step(batch)
    except Exception as exc:  # noqa: BLE001 - the run must go on; its own step will say what is wrong
        return f"two forward passes of training_step on the first batch could not be compared ({type(exc).__name__})"
    if first is None or torch.allclose(first.double(), second.double(), rtol=SAME_LOSS, atol=0.0, equal_nan=True):
        return None
    return DRAWS_RANDOM
