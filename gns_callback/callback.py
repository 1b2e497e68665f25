"""``GradientNoiseScaleCallback``: measures ``B_simple`` while a Lightning ``Trainer`` fits.

Framework glue only; the math lives in :mod:`gns_callback.estimators`, :mod:`gns_callback.accumulation`
and :mod:`gns_callback.smoothing`. Where the gradients are read, and in what state (Lightning 2.x):

* each micro-batch's local gradient: parameter hooks (``micro_batch``) or per-layer hooks
  (``per_example``) during backward — AMP-scaled, divided by ``accumulate_grad_batches``, before DDP;
* the gradient the optimizer steps on: ``.grad`` in ``on_before_optimizer_step`` — after the GradScaler's
  ``unscale_``, before gradient clipping, DDP-averaged.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities.data import extract_batch_size
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from pytorch_lightning.utilities.rank_zero import rank_zero_info, rank_zero_warn

from gns_callback.accumulation import AccumulationWindow, step_estimates
from gns_callback.collectors.micro_batch import MicroBatchGradNorms
from gns_callback.estimate import GNSEstimate
from gns_callback.json_values import json_safe
from gns_callback.lr_multiplier import rescale_learning_rates
from gns_callback.probe import ProbeResult
from gns_callback.recommendation import AdaptPolicy, Recommendation, recommend, warmup_epochs_for, warmup_lr
from gns_callback.report import DEFAULT_REPORT_NAME, write_report
from gns_callback.smoothing import RatioAccumulator, step_vector

METHODS = ("auto", "micro_batch", "per_example")
LOSS_REDUCTIONS = ("mean", "sum")
STATE_VERSION = 1


class GradientNoiseScaleCallback(pl.Callback):
    """Measures the simple gradient noise scale ``B_simple = tr(Σ)/|G|²`` (McCandlish et al. 2018) during fit.

    Args:
        method: where small-batch gradients come from. ``"micro_batch"``: each accumulation micro-batch
            and/or each DDP rank's local gradient (needs ``accumulate_grad_batches × world_size ≥ 2``).
            ``"per_example"``: per-example gradient norms inside each batch (any setup; not valid with
            BatchNorm in training mode). ``"auto"``: ``per_example`` where valid, else ``micro_batch``.
        ema_decay: in ``[0, 1)``; weight of the past in the exponential moving averages of ``tr(Σ)`` and
            ``|G|²`` (smoothed separately, ratio formed when read). ``0.99`` ≈ the last 200 steps.
            A run average (equal weights) is kept too: ``run_estimate``.
        confidence: level of the reported interval, in ``(0, 1)``.
        loss_reduction: ``"mean"`` (Lightning's convention: the loss is the mean over the batch) or
            ``"sum"``. Wrong here means a wrong estimate, so say which your ``training_step`` returns.
        log_every_n_steps: log ``gns/*`` every this many optimizer steps (``None``: the Trainer's setting).
            Reading values costs one device sync, so it happens only then.
        report_path: where rank zero writes the JSON report at fit end (``None``:
            ``<trainer.log_dir>/gns_report.json``).
        verbose: print a one-line summary on rank zero at fit end.
        per_example_max_examples: ``per_example`` computes per-example norms for at most this many examples of
            each micro-batch (the first ones; ``None``: all). Their mean squared norm stays unbiased for i.i.d.
            batches, and the small-batch term weighs only ``1/(B−1)`` in ``|G|²``, so the estimate loses little
            precision while the cost (about one extra weight-gradient computation for the measured examples)
            drops by ``B/max``. The big-batch gradient always covers the whole batch.
        probe: at the first training batch, measure the largest micro-batch that fits in memory and the
            throughput per micro-batch size (:mod:`gns_callback.probe`; the run is left exactly as it was).
        memory_budget_bytes, headroom: the probe's budget (``None``: the device's memory) and the fraction of
            it a micro-batch may use.
        recommend: compute a batch size / learning rate :class:`~gns_callback.recommendation.Recommendation`
            from the run-average estimate (logged at each logging point, printed and reported at fit end).
        min_batch_size, max_batch_size, batch_multiple_of, power_of_two, lr_rule, price_per_device_hour:
            passed to :func:`~gns_callback.recommendation.recommend` (bounds, rounding, ``"linear"``/``"sqrt"``
            override, cost per device-hour).
        summary_every_n_epochs: also print the recommendation table every this many epochs.
        adapt: apply the recommendation while training (opt-in): at epoch starts, change
            ``accumulate_grad_batches`` (hysteresis: a change must persist ``adapt_patience`` checks beyond a
            factor ``adapt_factor``) and scale the learning rate by the rule with a linear warmup ramp.

    After fit: ``estimate`` (EMA) and ``run_estimate`` (run average) are :class:`GNSEstimate` objects,
    ``probe`` the probe result (or None) and ``recommendation`` the recommendation (or None); with
    ``strategy="ddp_spawn"`` read the report (:func:`gns_callback.read_report`) instead.

    Assumptions: batches are drawn i.i.d. (shuffling a large data set is close enough; the finite-population
    correction is ``(N−B)/(N−1)``); the gradient is that of ``loss_reduction`` over the batch; steps are
    roughly independent (for the interval).
    """

    def __init__(
        self,
        method: str = "auto",
        ema_decay: float = 0.99,
        confidence: float = 0.95,
        loss_reduction: str = "mean",
        log_every_n_steps: Optional[int] = None,
        report_path: Optional[str] = None,
        verbose: bool = True,
        per_example_max_examples: Optional[int] = 16,
        probe: bool = False,
        memory_budget_bytes: Optional[int] = None,
        headroom: float = 0.85,
        recommend: bool = True,
        min_batch_size: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        batch_multiple_of: int = 8,
        power_of_two: bool = False,
        lr_rule: Optional[str] = None,
        price_per_device_hour: Optional[float] = None,
        summary_every_n_epochs: Optional[int] = None,
        adapt: bool = False,
        adapt_factor: float = 1.5,
        adapt_patience: int = 2,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"GradientNoiseScaleCallback(method={method!r}): use one of {', '.join(METHODS)}.")
        if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
            raise ValueError(
                f"GradientNoiseScaleCallback(ema_decay={ema_decay!r}): must be a number in [0, 1), "
                "e.g. 0.99 to average over roughly the last 200 steps."
            )
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
            raise ValueError(f"GradientNoiseScaleCallback(confidence={confidence!r}): must be in (0, 1), e.g. 0.95.")
        if loss_reduction not in LOSS_REDUCTIONS:
            raise ValueError(
                f"GradientNoiseScaleCallback(loss_reduction={loss_reduction!r}): use 'mean' (the loss is "
                "averaged over the batch, Lightning's convention) or 'sum'."
            )
        if per_example_max_examples is not None and (
            not isinstance(per_example_max_examples, int) or per_example_max_examples < 2
        ):
            raise ValueError(
                f"GradientNoiseScaleCallback(per_example_max_examples={per_example_max_examples!r}): an int ≥ 2, "
                "or None to measure every example of each batch."
            )
        if log_every_n_steps is not None and (not isinstance(log_every_n_steps, int) or log_every_n_steps < 1):
            raise ValueError(
                f"GradientNoiseScaleCallback(log_every_n_steps={log_every_n_steps!r}): a positive int, or None "
                "to follow the Trainer."
            )
        self.method = method
        self.ema_decay = float(ema_decay)
        self.confidence = float(confidence)
        self.loss_reduction = loss_reduction
        self.log_every_n_steps = log_every_n_steps
        self.report_path = report_path
        self.verbose = verbose
        self.per_example_max_examples = per_example_max_examples
        if not 0.0 < headroom <= 1.0:
            raise ValueError(f"GradientNoiseScaleCallback(headroom={headroom!r}): a fraction in (0, 1], e.g. 0.85.")
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(
                f"GradientNoiseScaleCallback(memory_budget_bytes={memory_budget_bytes!r}): a positive number of "
                "bytes, or None for the device's memory."
            )
        if lr_rule not in (None, "linear", "sqrt", "none"):
            raise ValueError(
                f"GradientNoiseScaleCallback(lr_rule={lr_rule!r}): 'linear' (SGD), 'sqrt' (Adam), 'none', or None "
                "to choose by optimizer."
            )
        if adapt and not recommend:
            raise ValueError("GradientNoiseScaleCallback(adapt=True) needs recommend=True: it applies the recommendation.")
        self.probe_enabled = probe
        self.memory_budget_bytes = memory_budget_bytes
        self.headroom = headroom
        self.recommend_enabled = recommend
        self.recommend_options = {
            "min_batch_size": min_batch_size,
            "max_batch_size": max_batch_size,
            "multiple_of": batch_multiple_of,
            "power_of_two": power_of_two,
            "lr_rule": lr_rule,
            "price_per_device_hour": price_per_device_hour,
        }
        self.summary_every_n_epochs = summary_every_n_epochs
        self.adapt = adapt
        self._adapt_policy = AdaptPolicy(factor=adapt_factor, patience=adapt_patience) if adapt else None
        self.probe_result: Optional[ProbeResult] = None
        self.recommendation: Optional[Recommendation] = None
        self.adaptations: list[dict[str, Any]] = []

        self._state_key: Optional[str] = None
        self.resolved_method: Optional[str] = None
        self._micro_norms = MicroBatchGradNorms()
        self._per_example = None  # a PerExampleNormTracker while fitting with method="per_example"
        self._measured_params: list[torch.nn.Parameter] = []
        self._window = AccumulationWindow()
        self._micro_size: Optional[int] = None
        self._coverage: dict[str, Any] = {}
        self._restored_method: Optional[str] = None
        self._reset_state()

    # ------------------------------------------------------------------ state
    def _reset_state(self) -> None:
        self._ema = RatioAccumulator(self.ema_decay)
        self._run = RatioAccumulator(1.0)
        self._steps_seen = 0  # optimizer steps offered for measurement
        self._unmeasurable = 0  # of which had one small batch only (nothing to compare)
        self._history: list[dict[str, Any]] = []
        self._window.reset()
        self._micro_batch_size: Optional[int] = None  # the first training batch's size (per device)
        self._base_lr: Optional[float] = None
        self._lr_multiplier = 1.0  # what adapt=True has applied on top of the user's LR
        self._lr_ramp: Optional[dict[str, float]] = None
        self.probe_result = None
        self.recommendation = None
        self.adaptations = []

    @property
    def state_key(self) -> str:
        # Lightning reads this at every hook call: build the string once.
        if self._state_key is None:
            self._state_key = self._generate_state_key(method=self.method, ema_decay=self.ema_decay)
        return self._state_key

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "method": self.resolved_method,
            "ema": self._ema.state_dict(),
            "run": self._run.state_dict(),
            "steps_seen": self._steps_seen,
            "unmeasurable": self._unmeasurable,
            "history": list(self._history),
            "micro_batch_size": self._micro_batch_size,
            "base_lr": self._base_lr,
            "lr_multiplier": self._lr_multiplier,
            "lr_ramp": dict(self._lr_ramp) if self._lr_ramp else None,
            "adaptations": list(self.adaptations),
            "adapt_policy": self._adapt_policy.state_dict() if self._adapt_policy else None,
            "probe": self.probe_result.to_dict() if self.probe_result is not None else None,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._ema.load_state_dict(state_dict["ema"])
        self._run.load_state_dict(state_dict["run"])
        self._steps_seen = int(state_dict["steps_seen"])
        self._unmeasurable = int(state_dict["unmeasurable"])
        self._history = list(state_dict.get("history", []))
        self._micro_batch_size = state_dict.get("micro_batch_size")
        self._base_lr = state_dict.get("base_lr")
        self._lr_multiplier = float(state_dict.get("lr_multiplier", 1.0))
        self._lr_ramp = state_dict.get("lr_ramp")
        self.adaptations = list(state_dict.get("adaptations", []))
        if self._adapt_policy is not None and state_dict.get("adapt_policy"):
            self._adapt_policy.load_state_dict(state_dict["adapt_policy"])
        if state_dict.get("probe"):
            self.probe_result = ProbeResult.from_dict(state_dict["probe"])
        self._restored_method = state_dict.get("method")

    # ------------------------------------------------------------------ results
    def _estimate(self, accumulator: RatioAccumulator, averaging: str) -> GNSEstimate:
        measured = round(self._run.sums[0].item())  # the run average's weight counts the valid steps
        return GNSEstimate.from_summary(
            accumulator.summary(self.confidence),
            confidence=self.confidence,
            steps=measured,
            skipped_steps=self._steps_seen - measured,
            method=self.resolved_method or self.method,
            averaging=averaging,
        )

    @property
    def estimate(self) -> GNSEstimate:
        """The EMA estimate (recent window) with its interval. Reading it syncs the device once."""
        return self._estimate(self._ema, "ema")

    @property
    def probe(self) -> Optional[ProbeResult]:
        """The hardware probe's result after the first training batch (``probe=True``), else None."""
        return self.probe_result

    @property
    def history(self) -> list[dict[str, Any]]:
        """The estimate at each logging point: step, b_simple, ci_low, ci_high, b_simple_run, run_ci_*."""
        return list(self._history)

    @property
    def run_estimate(self) -> GNSEstimate:
        """The run-average estimate (all measured steps weighted equally)."""
        return self._estimate(self._run, "run")

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage == "fit":
            # Before checkpoint restore (which calls load_state_dict): a fresh fit starts from zero.
            self._reset_state()
            self._restored_method = None

    def on_fit_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not pl_module.automatic_optimization:
            raise MisconfigurationException(
                "GradientNoiseScaleCallback needs automatic optimization (one optimizer stepped by Lightning); "
                f"{type(pl_module).__name__} sets `automatic_optimization = False`. Remove the callback or use "
                "automatic optimization."
            )
        if self.adapt and _has_accumulation_schedule(trainer):
            raise MisconfigurationException(
                "GradientNoiseScaleCallback(adapt=True) changes accumulate_grad_batches itself; remove the "
                "GradientAccumulationScheduler callback or set adapt=False."
            )
        if self.adapt and self.adaptations:
            # Resumed after an adaptation: the Trainer starts from its constructor's value again. (The LR lives
            # in the restored optimizer and scheduler state.)
            trainer.accumulate_grad_batches = int(self.adaptations[-1]["accumulate_grad_batches"][1])
        self.resolved_method = self._resolve_method(trainer, pl_module)
        if self._restored_method and self._restored_method != self.resolved_method:
            rank_zero_warn(
                f"GradientNoiseScaleCallback: the checkpoint's running sums were measured with "
                f"method={self._restored_method!r}, this run uses {self.resolved_method!r}; they are combined."
            )
        if self.resolved_method == "per_example":
            self._measured_params = list(self._per_example.covered_parameters())
            self._per_example.enabled = True
        else:
            self._measured_params = [p for p in pl_module.parameters() if p.requires_grad]
            self._micro_norms.attach(self._measured_params)
            total = sum(p.numel() for p in self._measured_params)
            self._coverage = {"measured_parameters": total, "trainable_parameters": total, "fraction": 1.0}
        self._window.reset()

    def _resolve_method(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> str:
        can_micro = trainer.world_size * trainer.accumulate_grad_batches > 1 or _has_accumulation_schedule(trainer)
        if self.method == "micro_batch":
            if not can_micro:
                raise MisconfigurationException(
                    "GradientNoiseScaleCallback(method='micro_batch') compares each micro-batch's gradient with "
                    "the step's gradient, so it needs several micro-batches per optimizer step: set "
                    "Trainer(accumulate_grad_batches=2) or more, or train on 2+ devices, or use "
                    "method='per_example'."
                )
            return "micro_batch"
        per_example_reason = self._try_per_example(pl_module)
        if self.method == "per_example":
            if per_example_reason is not None and self._per_example is None:
                raise MisconfigurationException(f"GradientNoiseScaleCallback(method='per_example'): {per_example_reason}")
            if per_example_reason is not None:
                rank_zero_warn(f"GradientNoiseScaleCallback(method='per_example'): {per_example_reason}")
            return "per_example"
        # auto
        if per_example_reason is None:
            return "per_example"
        self._release_per_example()
        if can_micro:
            rank_zero_info(f"GradientNoiseScaleCallback: method='auto' uses 'micro_batch' ({per_example_reason}).")
            return "micro_batch"
        raise MisconfigurationException(
            f"GradientNoiseScaleCallback(method='auto') found no valid estimator: per-example norms are not "
            f"usable ({per_example_reason}) and there is one micro-batch per step on one device. Set "
            "Trainer(accumulate_grad_batches=2) or more (or use 2+ devices) for method='micro_batch'."
        )

    def _try_per_example(self, pl_module: "pl.LightningModule") -> Optional[str]:
        """Attach per-example hooks; return why per-example norms are not (fully) valid, or None."""
        try:
            from gns_callback.per_example import PerExampleNormTracker
        except ImportError:  # pragma: no cover - the sub-package ships with the package
            return "per-example norms are not available in this installation"
        tracker = PerExampleNormTracker(pl_module, max_examples=self.per_example_max_examples)
        tracker.attach()
        self._per_example = tracker
        measured = sum(p.numel() for p in tracker.covered_parameters())
        total = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        self._coverage = {
            "measured_parameters": measured,
            "trainable_parameters": total,
            "fraction": measured / total if total else 0.0,
            "excluded": {name: reason for name, reason in getattr(tracker, "excluded_reasons", {}).items()},
            "uncovered": [name for name, _ in tracker.uncovered_parameters()],
        }
        if measured == 0:
            self._release_per_example()
            return "no parameter is in a supported layer (Linear, Conv1d/2d, Embedding, LayerNorm, GroupNorm)"
        if tracker.has_batchnorm_in_training():
            return (
                "the model has BatchNorm in training mode, which couples the examples of a batch, so "
                "per-example gradients are not independent samples"
            )
        return None

    def _release_per_example(self) -> None:
        if self._per_example is not None:
            self._per_example.detach()
            self._per_example = None

    def _detach_all(self) -> None:
        self._micro_norms.detach()
        self._release_per_example()

    # ------------------------------------------------------------------ per micro-batch
    def on_train_batch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int) -> None:
        if self.resolved_method == "micro_batch" or self._micro_batch_size is None:
            size = extract_batch_size(batch)  # per_example reads sizes off its hooks; it needs this once
            self._micro_size = size
            if self._micro_batch_size is None:
                self._micro_batch_size = size
        if self._base_lr is None and trainer.optimizers:
            group = trainer.optimizers[0].param_groups[0]
            self._base_lr = float(group.get("initial_lr", group["lr"]))
        if self.probe_enabled and self.probe_result is None:
            self._run_probe(trainer, pl_module, batch)

    def _run_probe(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any) -> None:
        """Probe on every rank (they agree through one min all-reduce); our own hooks must not see it."""
        from gns_callback.probe import probe_trainer

        if self._per_example is not None:
            self._per_example.enabled = False
        try:
            self.probe_result = probe_trainer(
                trainer,
                pl_module,
                batch,
                memory_budget_bytes=self.memory_budget_bytes,
                headroom=self.headroom,
                # Throughput where the decision is made: the current micro-batch and its doublings (the probe
                # adds the largest size that fits).
                throughput_sizes=[self._micro_batch_size * 2**k for k in range(6)],
                progress_bar=self.verbose,
            )
        finally:
            if self._per_example is not None:
                self._per_example.enabled = True
                self._per_example.pop()
            self._micro_norms.pop()
        if self.verbose:
            rank_zero_info(f"GradientNoiseScaleCallback: {self.probe_result.summary()}")

    def on_after_backward(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        accumulate = trainer.accumulate_grad_batches
        if self.resolved_method == "per_example":
            per_example = self._per_example.pop()
            if per_example is None:
                return
            b, measured = self._per_example.last_batch_size, per_example.shape[0]
            # Hook-level per-example gradients carry 1/(accumulate) and, for a mean loss, 1/b.
            factor = float(accumulate * b if self.loss_reduction == "mean" else accumulate) ** 2
            self._window.add_micro_batch(per_example.sum(), float(measured), float(measured), b, weight=factor)
            return
        sq = self._micro_norms.pop()
        if sq is None or not self._micro_size:
            return
        b = self._micro_size
        factor = float(accumulate if self.loss_reduction == "mean" else accumulate / b) ** 2
        self._window.add_micro_batch(sq, float(b), 1.0, b, weight=b * factor)

    # ------------------------------------------------------------------ per optimizer step
    def on_before_optimizer_step(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer: Any) -> None:
        if self.resolved_method is None:
            return
        if self._lr_ramp is not None:
            self._advance_lr_ramp(trainer)
        world_size = trainer.world_size
        if self._window.empty and world_size == 1:
            return
        self._steps_seen += 1
        if world_size == 1 and not self._window.measurable(self.loss_reduction):
            self._unmeasurable += 1  # e.g. a one-micro-batch window: nothing to compare
            self._window.reset()
            return
        device = pl_module.device
        packed = self._window.packed(device)
        self._window.reset()
        scale = _loss_scale(trainer)
        if scale is not None:  # small-batch norms were taken on scaled gradients; .grad is unscaled by now
            packed[0] = packed[0] / scale.to(device=device, dtype=torch.float64) ** 2
        if world_size > 1:
            packed = trainer.strategy.reduce(packed, reduce_op="sum")  # the one collective per step
        grads = [p.grad for p in self._measured_params if p.grad is not None]
        if not grads:
            return
        step_grad_sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        # .grad = (1/(world·accumulate))·Σ micro-batch gradients: undo it over the micro-batches present.
        divisor = packed[3] if self.loss_reduction == "mean" else packed[5]
        grad_to_mean = float(world_size * trainer.accumulate_grad_batches) / divisor
        trace, grad_sq, valid = step_estimates(packed, step_grad_sq, grad_to_mean, self.loss_reduction)
        step = step_vector(trace, grad_sq)  # shared by both accumulators; non-finite steps are not added
        self._ema.update_vector(step, valid)
        self._run.update_vector(step, valid)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if every and self._steps_seen % every == 0:
            self._log(trainer, pl_module)

    def _log(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        est, run = self.estimate, self.run_estimate
        if est.steps == 0:
            return
        self._history.append(
            json_safe(
                {
                    "step": trainer.global_step + 1,  # this optimizer step, counted from 1
                    "b_simple": est.b_simple,
                    "ci_low": est.ci_low,
                    "ci_high": est.ci_high,
                    "b_simple_run": run.b_simple,
                    "run_ci_low": run.ci_low,
                    "run_ci_high": run.ci_high,
                }
            )
        )
        metrics = {}
        if self.recommend_enabled:
            rec = self._recommend(trainer, run)
            if rec is not None:
                metrics["gns/recommended_batch_size"] = float(rec.batch_size)
                metrics["gns/recommended_micro_batch_size"] = float(rec.micro_batch_size)
                metrics["gns/recommended_accumulate_grad_batches"] = float(rec.accumulate_grad_batches)
                if rec.learning_rate is not None:
                    metrics["gns/recommended_lr"] = float(rec.learning_rate)
        pl_module.log_dict(
            {
                **metrics,
                "gns/b_simple": est.b_simple,
                "gns/grad_sq_norm": est.grad_sq_norm,
                "gns/trace_sigma": est.trace_sigma,
                "gns/b_simple_ci_low": est.ci_low,
                "gns/b_simple_ci_high": est.ci_high,
                "gns/b_simple_run": run.b_simple,
            },
            on_step=True,
            on_epoch=False,
        )

    # ------------------------------------------------------------------ recommendation
    def _recommend(self, trainer: "pl.Trainer", estimate: GNSEstimate) -> Optional[Recommendation]:
        """The recommendation for this run from ``estimate`` (pure; the same on every rank)."""
        if self._micro_batch_size is None or not trainer.optimizers:
            return None
        accumulate = trainer.accumulate_grad_batches
        world = trainer.world_size
        base_lr = None if self._base_lr is None else self._base_lr * self._lr_multiplier
        return recommend(
            estimate,
            current_batch_size=self._micro_batch_size * accumulate * world,
            current_lr=base_lr,
            optimizer=trainer.optimizers[0],
            num_devices=world,
            current_micro_batch_size=self._micro_batch_size,
            current_accumulate=accumulate,
            probe=self.probe_result,
            dataset_size=_dataset_size(trainer),
            steps_per_epoch=_steps_per_epoch(trainer),
            **self.recommend_options,
        )

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        if not self.adapt or trainer.current_epoch == 0 or self._micro_batch_size is None:
            return
        # Adaptation follows the recent (EMA) estimate: the noise scale grows as training progresses.
        rec = self._recommend(trainer, self.estimate)
        if rec is None:
            return
        current = trainer.accumulate_grad_batches
        decision = self._adapt_policy.decide(current, rec, micro_batch_size=self._micro_batch_size,
                                             num_devices=trainer.world_size)
        if not decision.change:
            return
        rule = rec.lr_rule or "none"
        target = decision.new_lr(1.0, rule)  # LR ratio new/old for this batch change
        trainer.accumulate_grad_batches = decision.accumulate_grad_batches
        # Warmup by the recommendation's rule for this LR factor, in optimizer steps at the new batch size.
        warmup = math.ceil(warmup_epochs_for(target) * (_steps_per_epoch(trainer) or 0))
        self._lr_ramp = {"start": self._lr_multiplier, "target": self._lr_multiplier * target, "step": 0,
                         "warmup_steps": warmup}
        event = {
            "epoch": trainer.current_epoch,
            "global_step": trainer.global_step,
            "accumulate_grad_batches": [current, decision.accumulate_grad_batches],
            "batch_size": decision.batch_size,
            "lr_factor": target,
            "lr_rule": rule,
            "warmup_steps": warmup,
            "b_simple": json_safe(rec.b_noise),
            "reason": decision.reason,
        }
        self.adaptations.append(event)
        pl_module.log_dict(
            {"gns/adapt_accumulate_grad_batches": float(decision.accumulate_grad_batches),
             "gns/adapt_lr_factor": float(self._lr_ramp["target"])},
            on_step=False, on_epoch=True,
        )
        rank_zero_info(
            f"GradientNoiseScaleCallback(adapt=True): epoch {trainer.current_epoch}: accumulate_grad_batches "
            f"{current} → {decision.accumulate_grad_batches} (global batch {decision.batch_size}); LR ×{target:.3g} "
            f"({rule} rule) over {warmup} warmup steps. {decision.reason}"
        )

    def _advance_lr_ramp(self, trainer: "pl.Trainer") -> None:
        ramp = self._lr_ramp
        # Step k after the change (k = 1, 2, ...) runs at start + (target − start)·k/warmup, then flat.
        wanted = warmup_lr(int(ramp["step"]) + 1, start_lr=ramp["start"], target_lr=ramp["target"],
                           warmup_steps=int(ramp["warmup_steps"]))
        schedulers = [config.scheduler for config in trainer.lr_scheduler_configs]
        for optimizer in trainer.optimizers:
            rescale_learning_rates(optimizer, schedulers, wanted / self._lr_multiplier)
        self._lr_multiplier = wanted
        ramp["step"] += 1
        if wanted == ramp["target"]:
            self._lr_ramp = None

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        every = self.summary_every_n_epochs
        if self.recommend_enabled and every and (trainer.current_epoch + 1) % every == 0:
            rec = self._recommend(trainer, self.run_estimate)
            if rec is not None:
                rank_zero_info(f"GradientNoiseScaleCallback, epoch {trainer.current_epoch}:\n{rec.summary_table()}")

    # ------------------------------------------------------------------ end of fit
    def on_fit_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._detach_all()
        est = self.estimate
        if self.recommend_enabled:
            # From the run average: the critical batch of a run is the noise scale averaged along it.
            self.recommendation = self._recommend(trainer, self.run_estimate)
        if trainer.is_global_zero:
            path = self.write_report(trainer)
            if self.verbose:
                rank_zero_info(f"GradientNoiseScaleCallback: {est}\n  report: {path}")
                if self.recommendation is not None:
                    rank_zero_info(self.recommendation.summary_table())
                if est.steps and not math.isfinite(est.ci_high):
                    rank_zero_info(
                        "GradientNoiseScaleCallback: the interval is unbounded: |G|² is not resolved from the "
                        "noise yet; train longer or measure over more steps before trusting B_simple."
                    )

    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        self._detach_all()

    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._detach_all()

    def resolve_report_path(self, trainer: "pl.Trainer") -> str:
        if self.report_path is None:
            self.report_path = os.path.join(trainer.log_dir or trainer.default_root_dir, DEFAULT_REPORT_NAME)
        return self.report_path

    def report_sections(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """The report's content; later features add sections (recommendation, probe)."""
        return {
            "estimate": self.estimate.to_dict(),
            "run_estimate": self.run_estimate.to_dict(),
            "history": self._history,
            "recommendation": self.recommendation.to_dict() if self.recommendation is not None else None,
            "probe": self.probe_result.to_dict() if self.probe_result is not None else None,
            "adaptations": self.adaptations,
            "coverage": self._coverage,
            "config": {
                "method": self.method,
                "ema_decay": self.ema_decay,
                "confidence": self.confidence,
                "loss_reduction": self.loss_reduction,
                "per_example_max_examples": self.per_example_max_examples,
            },
            "run": {
                "world_size": trainer.world_size,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "precision": str(trainer.precision),
                "global_step": trainer.global_step,
            },
        }

    def write_report(self, trainer: "pl.Trainer") -> str:
        path = self.resolve_report_path(trainer)
        write_report(path, self.report_sections(trainer))
        return path


def _dataset_size(trainer: "pl.Trainer") -> Optional[int]:
    try:
        return len(trainer.train_dataloader.dataset)
    except (AttributeError, TypeError):
        return None


def _steps_per_epoch(trainer: "pl.Trainer") -> Optional[int]:
    batches = trainer.num_training_batches
    if not isinstance(batches, int) or batches <= 0:
        return None
    return math.ceil(batches / trainer.accumulate_grad_batches)


def _loss_scale(trainer: "pl.Trainer") -> Optional[torch.Tensor]:
    """The AMP GradScaler's current scale as a tensor (no host sync), or None without a scaler."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else torch.tensor(scaler.get_scale())


def _has_accumulation_schedule(trainer: "pl.Trainer") -> bool:
    from pytorch_lightning.callbacks import GradientAccumulationScheduler

    return any(
        isinstance(cb, GradientAccumulationScheduler) and any(v > 1 for v in cb.scheduling.values())
        for cb in trainer.callbacks
    )
