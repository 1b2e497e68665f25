"""Whether the gradients changed between the end of backward and the meter's read of ``|G_B|²``.

The small-batch norms are taken during backward; ``|G_B|²`` is read from ``.grad`` at the optimizer step. Anything
that changes ``.grad`` in between (gradient clipping or scaling in the training framework's hook after backward,
Lightning's ``LightningModule.on_after_backward``) mixes a changed ``|G_B|²`` with unchanged small-batch norms. On
the digits MLP, clipping at a norm of 0.6 there read B_simple = 87.8 (95% CI 78.9–99.0) against an exact 68.0.
Clipping where it belongs (Lightning's ``gradient_clip_val`` or ``configure_gradient_clipping``) runs after the read.

:class:`GradientWatch` keeps, when backward ends (:meth:`~GradientWatch.mark`; the meter marks the end of each
backward pass that fills ``.grad`` itself, after DDP's reduction), and checks at the read
(:meth:`~GradientWatch.verdict`):

- **Every measured parameter's** ``.grad`` tensor and its version counter, which every in-place change bumps
  (``clip_grad_norm_``, ``grad[rows] = 0``, ``grad.mul_``) and which a replaced or dropped ``.grad`` fails by
  identity. No device work, no sync. A change to a few layers only shows here: zeroing half of the first layer's
  gradient of the digits MLP after backward read B_simple = 773 (95% CI 390–33,600) against an exact 68.
- **The total squared norms** (of the measured parameters, and of those left out): all the read takes from
  ``.grad``. Kept at the first mark, then at every mark after a step whose gradients changed (one more reduction
  over the gradients). In one process, on a step of one backward pass, a change is answered with them: the read
  takes ``|G_B|²`` as the pass left it, where the per-example norms were taken, whatever the loop did after it.
  Clipping, zeroing part of a layer or clipping values before ``meter.step()`` measure as without them, number for
  number (``benchmarks/loop_gradient_changes.py``; before the meter marked the end of backward itself, clipping at
  the median batch-gradient norm read B_simple = 128.2, 95% CI 117.5–140.9, against an exact 68.0). The first step
  that changes the gradients with no total kept (after steps that left them alone) is skipped. With several
  passes a step, a change between them is already in the last mark's totals, and with several ranks a loop may
  reduce the gradients itself after backward: there a change to every gradient alike that leaves ``|G_B|²`` as it
  was (``clip_grad_norm_`` multiplies every gradient by 1 where it does not clip) is no change, and any other
  change stops the meter with the fix.
- **The squared norms of a few small parameters' gradients**, allowing for the AMP loss scale taken off in between.
  They catch changes through ``.data``, which bypasses the version counter, where the change reaches them (a uniform
  clipping or scaling does), and a loss scale given while the gradients are still scaled.

On an accelerator the norms are compared on the steps the meter agrees on (the first 8, then every 32nd; each a
host sync).
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
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from gns_callback.backward_passes import PassLedger, hooks_inert
from gns_callback.norms import squared_norm, squared_norm_sum
from gns_callback.own_hooks import OwnHook

#: Parameters whose norms are watched (the smallest, so that marking costs almost nothing).
WATCHED = 2
#: Relative change of a watched squared norm taken for a change (unscaling by a power of two is exact).
TOLERANCE = 1e-4

PROBLEM = (
    "the gradients changed between the end of backward and the optimizer step (clipping, scaling or zeroing part of "
    "them in on_after_backward, say), so the step's |G_B|² no longer matches the norms taken during backward and "
    "B_simple would be wrong. Clip with the Trainer's gradient_clip_val or configure_gradient_clipping, and change "
    "gradients in the LightningModule's on_before_optimizer_step: they run after the callback reads the gradients; "
    "in your own loop, call meter.step() before changing the gradients (a loop that reduces the gradients across "
    "ranks itself after backward calls meter.backward_done() once they are reduced). An AMP GradScaler's "
    "scaler.unscale_(optimizer) before meter.step() is such a change unless meter.step(loss_scale=) gets the scale "
    "the backward pass ran with (scaler.get_scale() read before it)"
)

#: Added to :data:`PROBLEM` in one process where the step ran several backward passes (gradient accumulation): the
#: recipe of PyTorch's AMP docs (unscale_, clip_grad_norm_, then the step) over accumulated passes ends here.
SEVERAL_PASSES = (
    ". This step ran {passes} backward passes, and only after a single one can the meter read |G_B|² as backward left "
    "it (a change between passes would be in it, unseen by the norms). Call meter.step() right after the step's last "
    "backward pass and before clip_grad_norm_ (with an AMP GradScaler: after scaler.unscale_(optimizer), with "
    "meter.step(loss_scale=) the scale read before scaler.update())"
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


@dataclass(frozen=True)
class Verdict:
    """What the read may take from ``.grad`` (:meth:`GradientWatch.verdict`): nothing to say; a ``problem`` (stop
    measuring, with this reason); ``skip`` this step (changed, with nothing kept to read instead); or ``totals``,
    ``|G_B|²`` over the measured and the left-out parameters as backward left them (before any loss scale was taken
    off), to read instead of ``.grad``."""

    problem: Optional[str] = None
    skip: bool = False
    totals: Optional[tuple[torch.Tensor, torch.Tensor]] = None


class GradientWatch:
    """Every one of ``params``' (and ``left_out``'s) ``.grad`` tensors and versions, and the squared norms of the
    smallest of ``params``, at the end of backward; checked at the read. Once the loop is seen changing gradients,
    also the total squared norms (:attr:`keep_total`), which are all the read takes from ``.grad``.

    ``read_at_mark``: on a step of one backward pass, a change is answered with the totals kept at the mark, read in
    place of ``.grad`` (one process: the per-example norms and those totals come from the same pass, so they agree
    whatever the loop does to ``.grad`` after it). Otherwise a change to every gradient alike is compared by the
    totals and any other change is a problem: with several passes, a change between them is already in the last
    mark's totals; with several ranks (no ``read_at_mark``), a loop may reduce the gradients across ranks itself
    after backward, a change the read must see."""

    def __init__(self, params: Sequence[nn.Parameter], left_out: Sequence[nn.Parameter] = (),
                 read_at_mark: bool = False) -> None:
        self.all = list(params)
        self.left_out = list(left_out)
        self.watched = [*self.all, *self.left_out]  # whose versions are kept
        self.params = sorted(self.all, key=lambda p: p.numel())[:WATCHED]
        self.read_at_mark = read_at_mark
        self._marked: Optional[list[Optional[torch.Tensor]]] = None
        self._versions: Optional[list[tuple[Optional[torch.Tensor], int]]] = None
        self._totals: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self._passes = 0  # marks since the last verdict: the step's backward passes
        #: Whether :meth:`mark` keeps the total squared norms (one more reduction over the gradients): at the first
        #: mark, then after each step whose gradients changed.
        self.keep_total = True

    def mark(self) -> None:
        """Backward has ended: keep every gradient's identity and version, the watched gradients' squared norms and,
        where :attr:`keep_total`, the total squared norms (on their device, no sync)."""
        self._versions = [_version_of(p.grad) for p in self.watched]
        self._marked = [None if p.grad is None else squared_norm(p.grad) for p in self.params]
        self._totals = (_total(self.all), _total(self.left_out)) if self.keep_total else None
        self._passes += 1

    def forget(self) -> None:
        """Drop the marks since the last verdict (the step they belong to is not read)."""
        self._versions, self._marked, self._totals, self._passes = None, None, None, 0

    def on_host(self) -> bool:
        """Whether the watched gradients live on the CPU (reading their norms costs no device sync)."""
        return all(p.device.type == "cpu" for p in self.params)

    def problem(self, loss_scale: Union[torch.Tensor, float, None] = None, norms: bool = True) -> Optional[str]:
        """:attr:`Verdict.problem` of :meth:`verdict`."""
        return self.verdict(loss_scale, norms).problem

    def verdict(self, loss_scale: Union[torch.Tensor, float, None] = None, norms: bool = True) -> Verdict:
        """How the gradients changed since :meth:`mark`, and what the read may take (:class:`Verdict`); forgets the
        mark. ``loss_scale``: the scale the backward passes ran with, taken off the gradients since. ``norms``: also
        compare squared norms (a host sync on an accelerator); the versions are always compared."""
        versions, self._versions = self._versions, None
        marked, self._marked = self._marked, None
        totals, self._totals = self._totals, None
        passes, self._passes = self._passes, 0
        change = None if versions is None else _version_change(self.watched, versions, scaled=loss_scale is not None)
        if change is not None and self._cleared():
            return Verdict(CLEARED)
        self.keep_total = change is not None
        if change is not None and self.read_at_mark and passes == 1:
            return Verdict(totals=totals) if totals is not None else Verdict(skip=True)
        problem = PROBLEM + SEVERAL_PASSES.format(passes=passes) if self.read_at_mark and passes > 1 else PROBLEM
        if change == CHANGED:
            return Verdict(problem)
        if marked is None or not norms:
            return Verdict()
        scale_sq = 1.0 if loss_scale is None else float(loss_scale) ** 2
        if totals is not None and change == ALIKE:
            return Verdict(problem if _differ(float(totals[0]), float(_total(self.all)) * scale_sq) else None)
        then = [None if norm is None else float(norm) for norm in marked]
        now = [None if p.grad is None else float(squared_norm(p.grad)) for p in self.params]
        if change is None and scale_sq != 1.0 and _tell_scales(then, now) and _same_norms(then, now, 1.0):
            return Verdict(STILL_SCALED)
        return Verdict(None if _same_norms(then, now, scale_sq) else problem)

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

CLEARED_BETWEEN = (
    "a backward pass of the step found .grad cleared after an earlier pass of the same step had filled it: "
    "meter.step() was not called at an optimizer step (the norms of that step's passes stayed in the next one), a "
    "backward pass that is not a training step (an evaluation with gradients) ran and was cleared between steps, or "
    "the gradients are cleared between the passes of one step, so |G_B|² would hold fewer backward passes than the "
    "step's norms. Call meter.step() at every optimizer step (measure_every_n_steps=n rests on the steps in "
    "between), after its last backward pass and before optimizer.zero_grad(), and run other backward passes inside "
    "`with meter.paused():`"
)


class StaleGradients:
    """Whether the first backward pass of a step found a nonzero ``.grad`` on ``param`` (one small parameter; read in
    its gradient hook, before accumulation), or a later pass found it cleared after an earlier one had filled it, on
    the first :data:`STALE_CHECKS` steps. Passes that fill no ``.grad`` (``torch.autograd.grad``) and paused ones are
    left out (:class:`~gns_callback.backward_passes.PassLedger`).

    A later pass that finds ``.grad`` cleared is a step whose ``meter.step()`` was forgotten (its passes' norms
    stay for the next step, whose ``.grad`` holds only its own), or a loop clearing the gradients between the passes
    of one step. Before it was caught, calling ``meter.step()`` at 9 of every 10 steps of the digits MLP read
    B_simple = 147.2, 95% CI 112.8–200.9, against an exact 68.0, and a backward pass of 100 examples cleared after
    every 5th step (an evaluation with gradients outside ``meter.paused()``) 146.5, 121.3–179.7; calling it at every
    10th read ∞, [0, ∞], with nothing said.

    After those steps, with the hook off, each pass's end (:meth:`pass_ended`) keeps ``.grad``'s tensor object: a
    later pass of the step that ends on another one found ``.grad`` set to None and made anew (``zero_grad()``'s
    default), which costs no host sync (``same_tensor=False``: not where DDP may swap in its bucket views; nor for a
    sparse ``.grad`` or one that requires grad, which autograd accumulates out of place). Before,
    an evaluation pass with gradients every 10th step from step 9 on read B_simple = 100.4 (95% CI 78.1–132.9)
    against an exact 68.0, with nothing said."""

    def __init__(self, param: nn.Parameter, same_tensor: bool = True) -> None:
        self.param = param
        self.same_tensor = same_tensor  # whether .grad stays one tensor across a step's passes unless cleared
        self._kept: Optional[torch.Tensor] = None  # .grad as the step's last pass ended
        self._replaced = False  # a later pass of the step ended on another .grad tensor
        self.checks_left = STALE_CHECKS
        self.enabled = True  # False: passes aside from the run's steps (validation with gradients) are not looked at
        self._passes: PassLedger[list] = PassLedger(new=list, merge=operator.add)
        self._passes.watch([param])
        self._handle = param.register_hook(OwnHook(self._on_grad))

    def remove(self) -> None:
        self._handle.remove()
        self._passes.unwatch()
        self.checks_left = 0

    def _on_grad(self, grad: torch.Tensor) -> None:
        if hooks_inert() or not self.enabled:
            return
        held = self._passes.record(self._passes.current())
        if not held:  # this pass's first look: what .grad held before it, and what the pass brings
            held.extend((_largest(self.param.grad), _largest(grad)))

    def pass_ended(self) -> None:
        """A pass of the step ended: whether ``.grad`` is still the tensor an earlier pass of the step ended on."""
        grad = self.param.grad
        if grad is None or grad.layout != torch.strided or grad.requires_grad:  # accumulated out of place
            self._kept = None
        elif self.same_tensor and self.enabled:
            self._replaced = self._replaced or (self._kept is not None and grad is not self._kept)
            self._kept = grad

    def forget(self) -> None:
        """Drop the passes since the last :meth:`problem` (the step they belong to is not read: the re-evaluations of
        an LBFGS closure, say)."""
        self._passes.clear()
        self._kept, self._replaced = None, False

    def problem(self) -> Optional[str]:
        """At the read: :data:`STALE` if this step's first pass found a gradient, :data:`CLEARED_BETWEEN` if a later
        pass found it cleared after an earlier one had filled it, else None; forgets the step. After
        :data:`STALE_CHECKS` steps the hooks come off, and only a ``.grad`` made anew between passes is looked for."""
        passes = self._passes.pop()
        replaced, self._kept, self._replaced = self._replaced, None, False
        if not passes or not passes[0] or not _counted(self):
            return CLEARED_BETWEEN if replaced else None
        found = passes[0][0]
        if found is not None and float(found) > 0:
            return STALE
        cleared = any(_filled(earlier) and _empty(later[0]) for earlier, later in zip(passes, passes[1:]))
        return CLEARED_BETWEEN if cleared else None


AVERAGED_ACROSS_RANKS = (
    "this process is one of several data-parallel ranks, and backward left in .grad another gradient than this "
    "rank's own (DDP averages it over the ranks as backward ends), while the per-example or micro-batch norms are "
    "this rank's: B_simple would be wrong (digits MLP, 2 Fabric DDP ranks of 128 examples each: 95.8, 95% CI "
    "92.1–99.8, against an exact 68.0). Pass GradientNoiseScaleMeter(..., reduce=lambda t: fabric.all_reduce(t, "
    "reduce_op='sum')) under Lightning Fabric, or reduce=gns_callback.meter.all_reduce_sum under torch.distributed, "
    "and call meter.step() on every rank"
)


def world_size() -> int:
    """The ``torch.distributed`` ranks (1 where no process group is initialized)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def several_ranks() -> bool:
    """Whether this process is one of several ``torch.distributed`` ranks."""
    return world_size() > 1


class RankOwnGradient:
    """Whether backward left in ``.grad`` of ``param`` (one small parameter) what this rank's passes brought it (read
    in its gradient hook, before accumulation), compared as each pass ends, on the first :data:`STALE_CHECKS` steps
    and only while several ``torch.distributed`` ranks run (:func:`several_ranks`).

    The meter without ``reduce`` measures one process: its norms are this rank's. Under DDP ``.grad`` holds the
    gradient averaged over the ranks, so ``E|G_B|²`` is that of the global batch while the norms take it for the
    rank's: ``|G|²`` reads low by about ``tr Σ·(1 − 1/W)/(b − 1)`` at ``b`` examples on each of ``W`` ranks. Before
    this check, a Fabric DDP loop that left ``reduce=`` out read B_simple = 95.8 (95% CI 92.1–99.8) against an
    exact 68.0 on the digits MLP (2 ranks of 128), and ∞ [0, ∞] at 16 a rank, with nothing said."""

    def __init__(self, param: nn.Parameter) -> None:
        self.param = param
        self.checks_left = STALE_CHECKS
        self.enabled = True  # False: passes aside from the run's steps are not looked at
        self._expected: Optional[torch.Tensor] = None  # what .grad should hold once the pass ends
        self._found = False
        self._handle = param.register_hook(OwnHook(self._on_grad))

    def remove(self) -> None:
        self._handle.remove()
        self.checks_left = 0

    def _on_grad(self, grad: torch.Tensor) -> None:
        if hooks_inert() or not self.enabled or grad.layout != torch.strided or not several_ranks():
            return
        held = self.param.grad
        self._expected = grad.detach().clone() if held is None else held.detach() + grad.detach()

    def pass_ended(self) -> None:
        """A backward pass ended (after DDP's reduction): whether ``.grad`` is what the rank's pass brought."""
        expected, self._expected = self._expected, None
        now = self.param.grad
        if expected is not None and now is not None and now.layout == torch.strided:
            self._found = self._found or _strays(now.detach(), expected)

    def forget(self) -> None:
        """Drop what the passes since the last :meth:`problem` brought (their step is not read)."""
        self._expected, self._found = None, False

    def problem(self) -> Optional[str]:
        """At the read: :data:`AVERAGED_ACROSS_RANKS` if a pass of this step left another gradient than its own,
        else None; forgets the step. After :data:`STALE_CHECKS` steps the hook comes off."""
        found, self._found, self._expected = self._found, False, None
        return AVERAGED_ACROSS_RANKS if _counted(self) and found else None


def _counted(watch: Union[StaleGradients, RankOwnGradient]) -> bool:
    """Whether ``watch`` still checks steps (its first :data:`STALE_CHECKS`): counts this one, and takes its hook off
    after the last."""
    if watch.checks_left <= 0:
        return False
    watch.checks_left -= 1
    if watch.checks_left == 0:
        watch.remove()
    return True


def _strays(now: torch.Tensor, expected: torch.Tensor) -> bool:
    """Whether ``|now − expected|² > TOLERANCE·|expected|²`` (a host sync; not for non-finite gradients)."""
    whole, off = float(squared_norm(expected)), float(squared_norm(now - expected))
    return math.isfinite(whole) and math.isfinite(off) and off > TOLERANCE * max(whole, 1e-30)


def _largest(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The largest magnitude in a (dense) gradient, on its device; None for none, or a sparse one (not read)."""
    if grad is None or grad.layout != torch.strided:
        return None
    return grad.detach().abs().amax()


def _filled(held: list[Optional[torch.Tensor]]) -> bool:
    """Whether a pass's looks (``.grad`` before, then what the pass brought; one pair per pass merged into it) show
    it bringing a nonzero gradient."""
    return any(brought is not None and float(brought) > 0 for brought in held[1::2])


def _empty(before: Optional[torch.Tensor]) -> bool:
    """Whether ``.grad`` held nothing (None, or zeros) when a pass began."""
    return before is None or float(before) == 0


def _total(params: Sequence[nn.Parameter]) -> torch.Tensor:
    return squared_norm_sum([p.grad for p in params if p.grad is not None])


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
