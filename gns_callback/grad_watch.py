"""Whether the gradients changed between the end of backward and the meter's read of ``|G_B|²``.

The small-batch norms are taken during backward; ``|G_B|²`` is read from ``.grad`` at the optimizer step. Anything
that changes ``.grad`` in between (gradient clipping or scaling in the training framework's hook after backward,
Lightning's ``LightningModule.on_after_backward``) mixes a changed ``|G_B|²`` with unchanged small-batch norms. On
the digits MLP, clipping at a norm of 0.6 there read B_simple = 87.8 (95% CI 78.9–99.0) against an exact 68.0.
Clipping where it belongs (Lightning's ``gradient_clip_val`` or ``configure_gradient_clipping``) runs after the read.

:class:`GradientWatch` keeps the squared norms of a few small parameters' gradients when backward ends
(:meth:`~GradientWatch.mark`) and compares them at the read (:meth:`~GradientWatch.problem`), allowing for the AMP
loss scale that is taken off in between. A uniform change (clipping, scaling) shows in every parameter; a change to
some layers only shows if it reaches a watched one.

:func:`uncleared_gradients` catches the other way ``.grad`` goes wrong before the read: trainable parameters that no
optimizer param group holds (a backbone left trainable while only the head is optimized) get gradients that
``optimizer.zero_grad()`` never clears, so they grow from step to step. Torch only, no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from gns_callback.norms import squared_norm

#: Parameters watched (the smallest, so that marking costs almost nothing).
WATCHED = 2
#: Relative change of a watched squared norm taken for a change (unscaling by a power of two is exact).
TOLERANCE = 1e-4

PROBLEM = (
    "the gradients changed between the end of backward and the optimizer step (gradient clipping or scaling in "
    "on_after_backward, say), so the step's |G_B|² no longer matches the norms taken during backward and B_simple "
    "would be wrong. Clip with the Trainer's gradient_clip_val or configure_gradient_clipping, which run after the "
    "callback reads the gradients; in your own loop, call meter.step() before changing the gradients"
)


class GradientWatch:
    """Squared norms of the smallest of ``params``' gradients at the end of backward, checked at the read."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = sorted(params, key=lambda p: p.numel())[:WATCHED]
        self._marked: Optional[list[Optional[torch.Tensor]]] = None

    def mark(self) -> None:
        """Backward has ended: keep the watched gradients' squared norms (on their device, no sync)."""
        self._marked = [None if p.grad is None else squared_norm(p.grad) for p in self.params]

    def on_host(self) -> bool:
        """Whether the watched gradients live on the CPU (a check costs no device sync)."""
        return all(p.device.type == "cpu" for p in self.params)

    def forget(self) -> None:
        """Drop the mark unchecked (a step not checked on an accelerator)."""
        self._marked = None

    def problem(self, loss_scale: Union[torch.Tensor, float, None] = None) -> Optional[str]:
        """:data:`PROBLEM` if a watched gradient changed since :meth:`mark` (``loss_scale``: the scale the backward
        passes ran with, taken off the gradients since), else None; forgets the mark. A host sync on an accelerator."""
        marked, self._marked = self._marked, None
        if marked is None:
            return None
        scale_sq = 1.0 if loss_scale is None else float(loss_scale) ** 2
        for param, then in zip(self.params, marked):
            now = None if param.grad is None else float(squared_norm(param.grad)) * scale_sq
            if then is not None and now is not None and _differ(float(then), now):
                return PROBLEM
        return None


def _differ(then: float, now: float) -> bool:
    """Whether two finite squared norms differ by more than :data:`TOLERANCE` (non-finite ones are a step the AMP
    scaler skips: not a change)."""
    if not (math.isfinite(then) and math.isfinite(now)):
        return False
    return abs(now - then) > TOLERANCE * max(then, now, 1e-30)


def uncleared_gradients(model: nn.Module, optimizer: Any) -> Optional[str]:
    """Why ``|G_B|²`` would be wrong because ``model`` has trainable parameters with a gradient that no param group of
    ``optimizer`` holds (its ``zero_grad`` leaves them to grow), with the fix; None if there are none. Call it after
    the first backward, before the optimizer step."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    left = [(name, p) for name, p in trainable if p.grad is not None and id(p) not in stepped]
    if not left:
        return None
    share = sum(p.numel() for _, p in left) / sum(p.numel() for _, p in trainable)
    names = ", ".join(repr(name) for name, _ in left[:3]) + (", ..." if len(left) > 3 else "")
    return (f"{len(left)} trainable parameter tensor(s) ({names}; {share:.0%} of the trainable parameters) get "
            "gradients but no optimizer param group holds them, so zero_grad never clears them and their .grad grows "
            "from step to step: |G_B|² would be wrong. Freeze them (requires_grad_(False)) or give them to the "
            "optimizer")
