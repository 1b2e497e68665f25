"""The loss in a training step's output, for the probe's backward pass (plain modules and LightningModules)."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def loss_from(output: Any, *, reduce: bool = False) -> Tensor:
    """The loss in a step's output: a scalar tensor, ``output["loss"]``, ``output.loss``; with ``reduce`` also the
    mean of a tensor or of a tuple's first element (shapes, not values, set the memory)."""
    if isinstance(output, Tensor):
        return output if output.numel() == 1 or not reduce else output.float().mean()
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output and reduce:
        return loss_from(output[0], reduce=True)
    if output is None:
        raise TypeError("the step returned None (Lightning's way to skip a batch): no loss to measure on this batch.")
    raise TypeError(
        f"the probe needs a loss from the step, got {type(output).__name__}; return a scalar tensor or a dict with "
        "'loss'."
    )
