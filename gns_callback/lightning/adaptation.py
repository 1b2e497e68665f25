"""``adapt=True``: apply the recommendation to a running Trainer (accumulation and the LR, with a warmup ramp).

The decision is pure (:class:`gns_callback.recommendation.AdaptPolicy`); here it is applied: the Trainer's
``accumulate_grad_batches`` changes at an epoch start (as ``GradientAccumulationScheduler`` does), and the LR moves
by the rule's factor along a linear warmup, scaling the param groups and every absolute LR of the schedulers
together (:mod:`gns_callback.lr_multiplier`) so the user's schedule keeps working, exactly ×factor.

Refused at fit start (:meth:`Adapter.unsupported`): schedulers whose LRs can't be scaled exactly (the factor
reported would not be the factor applied). Under ``micro_batch`` on one device accumulation never goes below 2:
with a single micro-batch per step there is nothing to compare, and measuring would stop. Accumulation is not lowered
where the rest of the fit would then take more optimizer steps than a ``OneCycleLR`` stepped per step has left: it
raises an error past its ``total_steps`` (:func:`too_short_schedules`), and the run would die; a warning says so.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from gns_callback.json_values import json_safe
from gns_callback.lr_multiplier import SCALABLE_SCHEDULERS, rescale_learning_rates, unscalable_schedulers
from gns_callback.recommendation import AdaptPolicy, Recommendation, warmup_epochs_for, warmup_lr


class Adapter:
    """Applies :class:`AdaptPolicy` decisions to a Trainer; checkpointable (plain types)."""

    def __init__(self, factor: float, patience: int) -> None:
        self.policy = AdaptPolicy(factor=factor, patience=patience)
        self.lr_multiplier = 1.0  # what has been applied on top of the user's LR
        self.ramp: Optional[dict[str, float]] = None
        self.events: list[dict[str, Any]] = []
        self.notices: list[str] = []  # for the callback to warn with (once each kind)
        self._held_for_schedule = False
        self.stopped: Optional[str] = None  # why adaptation stopped (the LR is set by something else), or None
        self._left: list[list[float]] = []  # each optimizer's group LRs as the last advance left them

    @staticmethod
    def unsupported(trainer: Any) -> Optional[str]:
        """Why adaptation can't be applied faithfully to this run (None: it can)."""
        names = unscalable_schedulers(config.scheduler for config in trainer.lr_scheduler_configs)
        if not names:
            return None
        known = ", ".join(cls.__name__ for cls in SCALABLE_SCHEDULERS)
        return (
            f"the LR scheduler {', '.join(sorted(set(names)))} may compute learning rates of its own, so the LR factor "
            f"adapt applies could silently differ from the one it reports. Use one of torch's schedulers ({known}), "
            "or set adapt=False and apply the recommendation (cb.recommendation) yourself."
        )

    def resume(self, trainer: Any) -> None:
        """After a restore the Trainer starts from its constructor's accumulation: re-apply the last change."""
        if self.events:
            trainer.accumulate_grad_batches = int(self.events[-1]["accumulate_grad_batches"][1])

    def consider(self, trainer: Any, rec: Recommendation, micro_batch_size: int, steps_per_epoch: Optional[int],
                 method: str) -> Optional[dict[str, Any]]:
        """Change accumulation now if the policy says so; the event (also kept in :attr:`events`), or None.

        ``method``: the one measuring now; ``micro_batch`` on one device keeps at least 2 micro-batches per step."""
        if self.stopped is not None:
            return None
        current = trainer.accumulate_grad_batches
        self.policy.min_accumulate = 2 if method == "micro_batch" and trainer.world_size == 1 else 1
        decision = self.policy.decide(current, rec, micro_batch_size=micro_batch_size, num_devices=trainer.world_size)
        if not decision.change or self._held_for_schedule_length(trainer, current, decision.accumulate_grad_batches):
            return None
        rule = rec.lr_rule or "none"
        factor = decision.new_lr(1.0, rule)
        trainer.accumulate_grad_batches = decision.accumulate_grad_batches
        warmup = math.ceil(warmup_epochs_for(factor) * (steps_per_epoch or 0))
        # The factor scales the LR meant for the current batch: the unfinished ramp's target, if one is running.
        meant = self.ramp["target"] if self.ramp else self.lr_multiplier
        self.ramp = {"start": self.lr_multiplier, "target": meant * factor, "step": 0, "warmup_steps": warmup}
        event = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "accumulate_grad_batches": [current, decision.accumulate_grad_batches],
            "batch_size": decision.batch_size,
            "lr_factor": factor,
            "lr_rule": rule,
            "warmup_steps": warmup,
            "b_simple": json_safe(rec.b_noise),
            "reason": decision.reason,
        }
        self.events.append(event)
        return event

    def _held_for_schedule_length(self, trainer: Any, current: int, new: int) -> bool:
        """Whether lowering accumulation from ``current`` to ``new`` must wait: the schedules of
        :func:`too_short_schedules` would run out of steps (a notice the first time)."""
        if new >= current:
            return False
        short = too_short_schedules(trainer, new)
        if not short:
            return False
        if not self._held_for_schedule:
            self._held_for_schedule = True
            self.notices.append(
                f"GradientNoiseScaleCallback(adapt=True): kept accumulate_grad_batches at {current} rather than lowering "
                f"it to {new}: the rest of the fit would then take more optimizer steps than {', '.join(short)} has "
                "left of its total_steps, and OneCycleLR raises an error past them. To follow the recommendation "
                "(cb.recommendation), start a run with it, or size total_steps for it."
            )
        return True

    def advance(self, trainer: Any) -> None:
        """One optimizer step along the LR ramp: step k after the change runs at start + (target − start)·k/warmup."""
        if self.stopped is not None or self._overwritten(trainer):
            return
        ramp = self.ramp
        if ramp is None:
            return
        wanted = warmup_lr(int(ramp["step"]) + 1, start_lr=ramp["start"], target_lr=ramp["target"],
                           warmup_steps=int(ramp["warmup_steps"]))
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        for optimizer in trainer.optimizers:
            rescale_learning_rates(optimizer, schedulers, wanted / self.lr_multiplier)
        self.lr_multiplier = wanted
        self._left = _group_lrs(trainer)
        ramp["step"] += 1
        if wanted == ramp["target"]:
            self.ramp = None

    def _overwritten(self, trainer: Any) -> bool:
        """Whether something other than a torch scheduler set a param group's LR since the last step adapt scaled: a
        module's ``optimizer_step`` that writes ``param_group["lr"]`` (a warmup or schedule of its own), say. That undoes
        the factor adapt reports, so adaptation stops, with a notice. Before, on the digits MLP with a cosine written in
        ``optimizer_step``, adapt reported LR ×5.0 while the LR stayed the module's own (×1.01), with no warning. A
        group's LR may be what adapt left, or what its optimizer's scheduler last set (``get_last_lr``)."""
        if self.lr_multiplier == 1.0 and self.ramp is None:
            return False
        expected = _scheduled_lrs(trainer)
        for index, (now, left) in enumerate(zip(_group_lrs(trainer), self._left)):
            for group, (lr, was) in enumerate(zip(now, left)):
                if _same(lr, was) or any(_same(lr, lrs[group]) for lrs in expected.get(index, []) if group < len(lrs)):
                    continue
                self._stop(f"param group {group}'s learning rate was set to {lr:.4g} (adapt left {was:.4g}) by "
                           "something other than a torch LR scheduler (a module's optimizer_step that writes "
                           "param_group['lr'], say), which undoes the LR factor adapt applies")
                return True
        return False

    def _stop(self, reason: str) -> None:
        """No more changes from now on: the LR is left as the run sets it. The multiplier applied so far stays what
        the recommendation reads (the groups nothing else writes keep it: a head's beside the backbone group
        ``BackboneFinetuning`` sets; an ``optimizer_step`` that writes every group is found at adapt's first write)."""
        self.stopped, self.ramp = reason, None
        self.notices.append(
            f"GradientNoiseScaleCallback(adapt=True) stops adapting: {reason}. Changes made so far stay "
            f"(accumulate_grad_batches); the LR is the run's own. Set the LR through a torch LR scheduler, or set "
            "adapt=False and apply the recommendation (cb.recommendation) yourself."
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr_multiplier": self.lr_multiplier,
            "lr_ramp": dict(self.ramp) if self.ramp else None,
            "adaptations": list(self.events),
            "policy": self.policy.state_dict(),
            "stopped": self.stopped,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_multiplier = float(state.get("lr_multiplier", 1.0))
        self.ramp = state.get("lr_ramp")
        self.events = list(state.get("adaptations", []))
        if state.get("policy"):
            self.policy.load_state_dict(state["policy"])
        self.stopped = state.get("stopped")


def _group_lrs(trainer: Any) -> list[list[float]]:
    """Each optimizer's param groups' LRs."""
    return [[group["lr"] for group in optimizer.param_groups] for optimizer in trainer.optimizers]


def _scheduled_lrs(trainer: Any) -> dict[int, list[list[float]]]:
    """By optimizer index: the LRs its schedulers last set (``get_last_lr``), one list per scheduler."""
    found: dict[int, list[list[float]]] = {}
    for config in trainer.lr_scheduler_configs:
        last = getattr(config.scheduler, "_last_lr", None)
        optimizer = getattr(config.scheduler, "optimizer", None)
        for index, candidate in enumerate(trainer.optimizers):
            if candidate is optimizer and last is not None:
                found.setdefault(index, []).append(list(last))
    return found


def _same(a: float, b: float) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)


def optimizer_steps_left(trainer: Any, accumulate: int) -> Optional[int]:
    """Optimizer steps the rest of the fit takes at ``accumulate`` from this epoch's start, by ``max_epochs`` and
    ``max_steps``, whichever ends it first (None: neither bounds it, or the epoch's length is unknown)."""
    bounds = []
    batches, max_epochs = trainer.num_training_batches, trainer.max_epochs
    if isinstance(batches, int) and batches > 0 and max_epochs is not None and max_epochs >= 0:
        bounds.append(math.ceil(batches / accumulate) * max(0, max_epochs - trainer.current_epoch))
    if trainer.max_steps is not None and trainer.max_steps >= 0:
        bounds.append(max(0, trainer.max_steps - trainer.global_step))
    return min(bounds) if bounds else None


def too_short_schedules(trainer: Any, accumulate: int) -> list[str]:
    """``OneCycleLR`` schedulers stepped per optimizer step with fewer steps left of their ``total_steps`` than the rest
    of the fit takes at ``accumulate`` (described, e.g. ``"OneCycleLR (44 steps left)"``): past them OneCycleLR raises
    ``ValueError``. Lightning sizes them with ``trainer.estimated_stepping_batches``, at the accumulation of fit start:
    before, adapt lowered accumulation under one and the run died in its last epoch ("Tried to step 49 times")."""
    steps = optimizer_steps_left(trainer, accumulate)
    if steps is None:
        return []
    short = []
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if config.interval != "step" or not isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
            continue
        left = scheduler.total_steps - scheduler.last_epoch
        if steps // max(1, config.frequency) > left:
            short.append(f"{type(scheduler).__name__} ({left} steps left)")
    return short
