"""Whether the gradients changed between the end of backward and the meter's read of ``|G_B|²``.

The small-batch norms are taken during backward; ``|G_B|²`` is read from ``.grad`` at the optimizer step. Anything
that changes ``.grad`` in between (gradient clipping or scaling in the training framework's hook after backward,
Lightning's ``LightningModule.on_after_backward``) mixes a changed ``|G_B|²`` with unchanged small-batch norms. On
the digits MLP, clipping at a norm of 0.6 there read B_simple = 87.8 (95% CI 78.9–99.0) against an exact 68.0.
Clipping where it belongs (Lightning's ``gradient_clip_val`` or ``configure_gradient_clipping``) runs after the read.

:class:`GradientWatch` keeps, when backward ends (:meth:`~GradientWatch.mark`; the meter marks the end of each
backward pass that fills ``.grad`` itself), and compares at the read (:meth:`~GradientWatch.problem`):

- **Every measured parameter's** ``.grad`` tensor and its version counter, which every in-place change bumps
  (``clip_grad_norm_``, ``grad[rows] = 0``, ``grad.mul_``) and which a replaced or dropped ``.grad`` fails by
  identity. No device work, no sync. A change to a few layers only shows here: zeroing half of the first layer's
  gradient of the digits MLP after backward read B_simple = 773 (95% CI 390–33,600) against an exact 68.
- **The total squared norm**, where every gradient changed alike (one op over all of them: ``clip_grad_norm_``,
  which multiplies every gradient, by 1 where it does not clip; AMP's unscaling, allowed for): the read takes
  only ``|G_B|²`` from ``.grad``, so a change that leaves it as it was changes nothing, and one that doesn't is a
  change. Kept at the first mark, then at every mark once such a change is seen (one more reduction over the
  gradients). In a loop of one's own, clipping at the median batch-gradient norm before ``meter.step()`` read
  B_simple = 128.2 (95% CI 117.5–140.9) against an exact 68.0 on the digits MLP: unseen before the meter marked the
  end of backward itself; now it stops at the first step that clips (``benchmarks/loop_gradient_changes.py``).
- **The squared norms of a few small parameters' gradients**, allowing for the AMP loss scale taken off in between.
  They catch changes through ``.data``, which bypasses the version counter, where the change reaches them (a uniform
  clipping or scaling does), and a loss scale given while the gradients are still scaled.

On an accelerator the norms are compared on the steps the meter agrees on (the first 8, then every 32nd; each a
host sync): a uniform change that starts later is found within 32 steps.
AMP's unscaling changes every gradient alike (torch 2.13 leaves the versions alone; another build may not).

:class:`StaleGradients` catches a step whose ``.grad`` already held a gradient when its first backward pass began (a
loop that calls ``meter.step()`` after every micro-batch of an accumulation window: on the digits MLP, B_simple =
3.7, 95% CI 3.5–3.9, against an exact 68). :func:`uncleared_gradients` catches the other way ``.grad`` goes wrong
before the read: trainable parameters that no optimizer param group holds (a backbone left trainable while only the
head is optimized) get gradients that ``optimizer.zero_grad()`` never clears, so they grow from step to step. Torch
only, no Lightning.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

from gns_callback.backward_passes import PassLedger, hooks_inert
from gns_callback.norms import squared_norm, squared_norm_sum

#: Parameters whose norms are watched (the smallest, so that marking costs almost nothing).
WATCHED = 2
#: Relative change of a watched squared norm taken for a change (unscaling by a power of two is exact).
TOLERANCE = 1e-4

PROBLEM = (
    "the gradients changed between the end of backward and the optimizer step (clipping, scaling or zeroing part of "
    "them in on_after_backward, say), so the step's |G_B|² no longer matches the norms taken during backward and "
    "B_simple would be wrong. Clip with the Trainer's gradient_clip_val or configure_gradient_clipping, and change "
    "gradients in the LightningModule's on_before_optimizer_step: they run after the callback reads the gradients; "
    "in your own loop, call meter.step() before changing the gradients"
)

STILL_SCALED = (
    "loss_scale= was given, but the gradients are still scaled: nothing took the scale off since backward. Pass "
    "loss_scale= only once the gradients are unscaled (scaler.unscale_(optimizer) before meter.step()), or pass no "
    "loss_scale while they are still scaled"
)
CLEARED = (
    "the step's gradient was read as zero while its backward passes had nonzero gradients: the gradients were "
    "cleared (optimizer.zero_grad()) or zeroed before the meter read them. Call meter.step() after backward and "
    "before optimizer.zero_grad()"
)


class GradientWatch:
    """Every one of ``params``' ``.grad`` tensors and versions, and the squared norms of the smallest of them, at the
    end of backward; checked at the read. Where the loop changes every gradient alike in place (clipping by the
    total norm, which multiplies every gradient, by 1 when it does not clip; unscaling), the total squared norm too,
    which is all the read takes from ``.grad``: kept at the first mark, and at every mark once such a change is seen
    (:attr:`keep_total`)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.all = list(params)
        self.params = sorted(self.all, key=lambda p: p.numel())[:WATCHED]
        self._marked: Optional[list[Optional[torch.Tensor]]] = None
        self._versions: Optional[list[tuple[Optional[torch.Tensor], int]]] = None
        self._total: Optional[torch.Tensor] = None
        #: Whether :meth:`mark` keeps the total squared norm (one more reduction over the gradients).
        self.keep_total = True

    def mark(self) -> None:
        """Backward has ended: keep every gradient's identity and version, the watched gradients' squared norms and,
        where :attr:`keep_total`, the total squared norm (on their device, no sync)."""
        self._versions = [_version_of(p.grad) for p in self.all]
        self._marked = [None if p.grad is None else squared_norm(p.grad) for p in self.params]
        self._total = squared_norm_sum(self._grads()) if self.keep_total else None

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.all if p.grad is not None]

    def on_host(self) -> bool:
        """Whether the watched gradients live on the CPU (reading their norms costs no device sync)."""
        return all(p.device.type == "cpu" for p in self.params)

    def problem(self, loss_scale: Union[torch.Tensor, float, None] = None, norms: bool = True) -> Optional[str]:
        """:data:`PROBLEM` (or :data:`CLEARED`, :data:`STILL_SCALED`) if a gradient changed since :meth:`mark` in a
        way that changes the read, else None; forgets the mark. ``loss_scale``: the scale the backward passes ran
        with, taken off the gradients since. ``norms``: also compare squared norms (a host sync on an accelerator);
        the versions are always compared."""
        versions, self._versions = self._versions, None
        marked, self._marked = self._marked, None
        total, self._total = self._total, None
        change = None if versions is None else _version_change(self.all, versions, scaled=loss_scale is not None)
        if change is not None and self._cleared():
            return CLEARED
        if change == CHANGED:
            return PROBLEM
        self.keep_total = change == ALIKE
        if marked is None or not norms:
            return None
        scale_sq = 1.0 if loss_scale is None else float(loss_scale) ** 2
        if total is not None and change == ALIKE:
            return PROBLEM if _differ(float(total), float(squared_norm_sum(self._grads())) * scale_sq) else None
        then = [None if norm is None else float(norm) for norm in marked]
        now = [None if p.grad is None else float(squared_norm(p.grad)) for p in self.params]
        if change is None and scale_sq != 1.0 and _tell_scales(then, now) and _same_norms(then, now, 1.0):
            return STILL_SCALED
        return None if _same_norms(then, now, scale_sq) else PROBLEM

    def _cleared(self) -> bool:
        """Whether the gradients were cleared: none left, or the watched ones all zero (a host sync, on a step
        already found changed)."""
        if all(p.grad is None for p in self.all):
            return True
        return all(p.grad is None or not bool(p.grad.any()) for p in self.params)


#: Steps whose first backward pass is checked (the mistake is in the loop's code, so it shows at every step); a
#: host read each only where ``.grad`` is kept between steps (``zero_grad(set_to_none=False)``).
STALE_CHECKS = 8

STALE = (
    "the step's first backward pass found .grad already holding a gradient from before the step: meter.step() is "
    "called more than once per optimizer step (after every micro-batch of an accumulation loop, say) or the "
    "gradients are not cleared between steps, so |G_B|² would hold backward passes the step's norms don't. Call "
    "meter.step() once per optimizer step, after its last backward pass and before optimizer.zero_grad()"
)


class StaleGradients:
    """Whether the first backward pass of a step found a nonzero ``.grad`` on ``param`` (one small parameter; read in
    its gradient hook, before accumulation), on the first :data:`STALE_CHECKS` steps. Passes that fill no ``.grad``
    (``torch.autograd.grad``) and paused ones are left out (:class:`~gns_callback.backward_passes.PassLedger`)."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param
        self.checks_left = STALE_CHECKS
        self._passes: PassLedger[list] = PassLedger(new=list, merge=operator.add)
        self._passes.watch([param])
        self._handle = param.register_hook(self._on_grad)

    def remove(self) -> None:
        self._handle.remove()
        self._passes.unwatch()
        self.checks_left = 0

    def _on_grad(self, grad: torch.Tensor) -> None:
        if hooks_inert():
            return
        held = self._passes.record(self._passes.current())
        if not held:  # this pass's first look: what .grad held before it
            held.append(None if self.param.grad is None else self.param.grad.detach().abs().amax())

    def problem(self) -> Optional[str]:
        """At the read: :data:`STALE` if this step's first pass found a gradient, else None; forgets the step. After
        :data:`STALE_CHECKS` steps the hooks come off."""
        passes = self._passes.pop()
        if self.checks_left <= 0 or not passes or not passes[0]:
            return None
        self.checks_left -= 1
        if self.checks_left == 0:
            self.remove()
        found = passes[0][0]
        return STALE if found is not None and float(found) > 0 else None


def _version_of(grad: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], int]:
    return grad, (0 if grad is None else grad._version)


#: :func:`_version_change`'s verdicts: every gradient changed in place alike, or some other way.
ALIKE, CHANGED = "alike", "changed"


def _version_change(params: Sequence[nn.Parameter], kept: Sequence[tuple[Optional[torch.Tensor], int]],
                    scaled: bool) -> Optional[str]:
    """How the ``.grad`` tensors changed since ``kept``: None (not at all), :data:`ALIKE` (every one changed in
    place the same number of times: one op over all of them), or :data:`CHANGED` (replaced, dropped, or some changed
    and others not). ``scaled``: a loss scale was taken off in between, which may coalesce sparse gradients into new
    tensors (not a change)."""
    deltas = set()
    for param, (grad, version) in zip(params, kept):
        if param.grad is grad:
            if grad is not None:
                deltas.add(grad._version - version)
        elif not (scaled and grad is not None and grad.layout != torch.strided):
            return CHANGED
    if deltas <= {0}:
        return None
    return ALIKE if len(deltas) == 1 else CHANGED


def _same_norms(then: Sequence[Optional[float]], now: Sequence[Optional[float]], scale_sq: float) -> bool:
    """Whether each watched squared norm ``now``, times ``scale_sq``, is the one ``then``."""
    return not any(_differ(a, b * scale_sq) for a, b in zip(then, now) if a is not None and b is not None)


def _tell_scales(then: Sequence[Optional[float]], now: Sequence[Optional[float]]) -> bool:
    """Whether a watched norm can tell a scale from none: finite, and nonzero then."""
    return any(a is not None and b is not None and 0.0 < a < math.inf and math.isfinite(b) for a, b in zip(then, now))


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
