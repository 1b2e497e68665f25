"""``GradientNoiseScaleCallback``: measures ``B_simple`` while a Lightning ``Trainer`` fits.

Glue only. The measurement is :class:`gns_callback.meter.GradientNoiseScaleMeter`; the recommendation
:func:`gns_callback.recommendation.recommend`; the probe :mod:`gns_callback.probe`. Each hook hands the meter what
Lightning knows: the micro-batch sizes, ``accumulate_grad_batches`` (the loss divisor), the AMP scale, and the
strategy's all-reduce. Where the gradients are read (Lightning 2.x):

* each micro-batch's local gradient: the collector's hooks during backward — AMP-scaled, divided by
  ``accumulate_grad_batches``, before DDP;
* the gradient the optimizer steps on: ``.grad`` in ``on_before_optimizer_step`` — after the GradScaler's
  ``unscale_``, before gradient clipping, DDP-averaged.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import warnings
from typing import Any, Optional

import torch

from gns_callback import arguments as args
from gns_callback.batch_size import batch_size_of
from gns_callback.collectors import METHODS, MIN_COVERAGE, UnmeasurableSetup, choose_method, per_example_problem
from gns_callback.critical_batch import critical_batch_target
from gns_callback.estimate import GNSEstimate
from gns_callback.grad_watch import uncleared_gradients
from gns_callback.json_values import json_safe
from gns_callback.lightning import supported
from gns_callback.lightning import trainer_facts as facts
from gns_callback.lightning.adaptation import Adapter
from gns_callback.lightning.compat import CALLBACK_BASES, misconfiguration
from gns_callback.lightning.per_example_check import check_first_batch
from gns_callback.lightning.sharpness import SharpnessMonitor
from gns_callback.meter import ARGUMENTS as METER_ARGUMENTS
from gns_callback.meter import GradientNoiseScaleMeter
from gns_callback.per_example.checks import SIZE_MISREAD
from gns_callback.probe import ProbeResult
from gns_callback.probe.lightning import ddp_static_graph
from gns_callback.random_streams import RandomDrawWatch, drawn_reason
from gns_callback.recommendation import Recommendation, recommend
from gns_callback.recommendation.calibration import CALIBRATED, uncalibrated_reason
from gns_callback.recommendation.learning_rate import param_groups_note, peak_schedule_note
from gns_callback.recommendation.objective import BALANCED, OBJECTIVES
from gns_callback.recommendation.rules import LR_RULES
from gns_callback.report import DEFAULT_REPORT_NAME, write_report
from gns_callback.sampling import UNKNOWN_DRAWS, draws_may_vary, population_of, unknown_draws

STATE_VERSION = 2
_UNKNOWN_DRAWS_FIX = ("Draw the batches with a sampler (DataLoader(shuffle=True), a RandomSampler, or the "
                      "DistributedSampler Lightning puts in); or, if each batch is examples drawn at random (a stream "
                      "shuffled each epoch, a batch sampler that draws at random), "
                      "GradientNoiseScaleCallback(data_in_random_order=True).")
_EPOCH_UNKNOWN = ("data_in_random_order=True on batches drawn by the loader itself: whether each epoch draws them "
                  "without replacement from the {population} examples can't be told, so the interval keeps the "
                  "upper end of draws with replacement")


class GradientNoiseScaleCallback(*CALLBACK_BASES):
    """Measures the simple gradient noise scale ``B_simple = tr(Σ)/|G|²`` (McCandlish et al. 2018) during fit.

    Args:
        method: where small-batch gradients come from. ``"micro_batch"``: each accumulation micro-batch
            and/or each DDP rank's local gradient (needs ``accumulate_grad_batches × world_size ≥ 2``).
            ``"per_example"``: per-example gradient norms inside each batch (any setup; not valid with
            BatchNorm in training mode). ``"auto"``: ``per_example`` where valid and covering at least 90% of the
            trainable parameters, else ``micro_batch``; if the per-example hooks then find a step they can't measure
            (a convolution applied twice, a gradient penalty, ...), it switches to ``micro_batch`` where the run has
            several micro-batches per step, and otherwise stops measuring (README, "When it can't measure").
        ema_decay: in ``[0, 1)``; weight of the past in the recent estimate's window
            (:class:`gns_callback.tracking.LocalLinearRatio`: a local linear fit of the ratio over
            normalised steps, which tracks a moving run). ``0.99`` ≈ the last 200 steps. A run average (equal
            weights) is kept too: ``run_estimate``.
        confidence: level of the reported interval, in ``(0, 1)``.
        loss_reduction: ``"mean"`` (Lightning's convention: the loss is the mean over the batch) or
            ``"sum"``. The first batch's check reads which it is (the step on the batch's first half, and on
            those rows twice: :mod:`gns_callback.loss_reduction`) and measures that one, with a warning where it
            differs from this; where it can't tell (another divisor, a penalty on the parameters), this stands.
        log_every_n_steps: log ``gns/*`` every this many optimizer steps (``None``: the Trainer's setting).
            Reading values costs one device sync, so it happens only then.
        report_path: where rank zero writes the JSON report at fit end (``None``:
            ``<trainer.log_dir>/gns_report.json``).
        verbose: print a one-line summary on rank zero at fit end.
        per_example_max_examples: ``per_example`` computes per-example norms for only this many examples of
            each micro-batch (the first ones) where that is cheaper than every example, by a per-layer cost model
            (:mod:`gns_callback.per_example.cost`: never for plain ``Linear`` layers; ``None``: always every example).
            ``tr Σ`` then comes from their mean squared norm, and
            ``|G|²`` from every pair of distinct examples that involves a measured one (the measured examples'
            summed gradient is also computed, about ``max/B`` of one weight gradient), both unbiased for i.i.d.
            batches (:mod:`gns_callback.accumulation`). A subset pays where the layers have many positions and the
            batch is several times the cap (a CNN at batch 64: 1.33× the step against 1.59× for every example). The big-batch gradient always covers the whole batch.
        probe: at the first training batch, measure the largest micro-batch that fits in memory and the
            throughput per micro-batch size (:mod:`gns_callback.probe`; the run is left exactly as it was; about
            2 s of timing). ``None`` (default): on when the run trains on an accelerator (CUDA, MPS, ...) or
            ``objective`` is not ``"balanced"``, off on CPU, where there is no device memory to find.
        memory_budget_bytes, headroom: the probe's budget (``None``: the device's memory) and the fraction of
            it a micro-batch may use.
        recommend: compute a batch size / learning rate :class:`~gns_callback.recommendation.Recommendation`
            from the run-average estimate (logged at each logging point, printed and reported at fit end). With
            ``False``, the arguments that only shape it (batch bounds and grid, price, objective, max_devices) must
            stay at their defaults (a ``ValueError`` otherwise).
        min_batch_size, max_batch_size, batch_multiple_of, power_of_two, lr_rule, price_per_device_hour:
            passed to :func:`~gns_callback.recommendation.recommend` (bounds, rounding, ``"linear"``/``"sqrt"``
            override, cost per device-hour).
        summary_every_n_epochs: also print the recommendation table every this many epochs.
        adapt: apply the recommendation while training (opt-in): at epoch starts, change
            ``accumulate_grad_batches`` (hysteresis: a change must persist ``adapt_patience`` checks beyond a
            factor ``adapt_factor``) and scale the learning rate by the rule with a linear warmup ramp.

        sharpness: for SGD-family optimizers, measure the largest Hessian eigenvalue ``λ_max`` at optimizer steps
            4, 8, …, 1024 on the step's own batch (:mod:`gns_callback.lightning.sharpness`; the run is left exactly
            as it was). A tuned SGD LR sits at the stability limit, so without it the recommendation keeps the LR
            when the batch grows; with it, the LR may rise up to ``2(1+β)/λ_max``.
        objective: what the recommended batch is for (:mod:`gns_callback.recommendation.objective`):
            ``"balanced"`` the knee ``B ≈ B_noise``; ``"time"`` the least predicted wall time to the same loss;
            ``"cost"`` the fewest device-hours. ``"time"``/``"cost"`` use the probe's measured step times, so they
            need ``probe=True``. The report and the printed table show all three.
        max_devices: let ``"time"``/``"cost"`` choose the device count up to this (``None``: the run's).
        measure_every_n_steps: measure one optimizer step in ``n`` (``1``: every step). The callback's cost per
            step falls about ``n``-fold (benchmarks/RESULTS.md, "Measuring one step in n"), and its intervals
            widen about ``√n``-fold at the same number of steps, more in short runs; ``ema_decay`` weighs measured
            steps, so the recent window spans ``n`` times as many optimizer steps. For long runs, where a quarter
            of the steps still measures the noise scale precisely. The probe, logging and the sharpness monitor are
            unaffected.
        data_in_random_order: the training data set is in a random order already (shuffled or drawn beforehand)
            and the DataLoader reads it in order (``shuffle=False``): measure its batches as random draws. Left
            ``False``, a training DataLoader that does not shuffle is refused at fit start: its batches are the same
            every epoch, not random draws (:mod:`gns_callback.sampling`). Likewise a DataLoader with a
            ``batch_sampler`` of its own, or over an ``IterableDataset``: ``True`` says each of its batches is
            examples drawn at random (a stream shuffled each epoch); then the data set's length is corrected for as
            a shuffled epoch, with the interval's upper end kept wide enough for draws with replacement.
        draws_vary: whether an example's gradient differs from one draw to the next (data augmentation as the data
            set loads it, a collate function of one's own, dropout). On shuffled epochs the estimate's correction
            for draws without replacement then may read ``B_simple`` low, by up to ``B_simple/N``, so the intervals'
            upper ends make room for it. ``None``: False only for a ``TensorDataset`` batched by torch's collate
            function under a model without dropout modules (:func:`gns_callback.sampling.draws_may_vary`) whose
            first training step draws no random numbers (:mod:`gns_callback.random_streams`: the random streams'
            states read before its forward and its backward pass).

    After fit: ``estimate`` (recent) and ``run_estimate`` (run average) are :class:`GNSEstimate` objects,
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
        probe: Optional[bool] = None,
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
        sharpness: bool = True,
        objective: str = "balanced",
        max_devices: Optional[int] = None,
        measure_every_n_steps: int = 1,
        data_in_random_order: bool = False,
        draws_vary: Optional[bool] = None,
    ) -> None:
        _check_arguments({name: value for name, value in locals().items() if name != "self"})
        # numpy numbers pass the checks; downstream (recommend(), the report's JSON) takes Python's own
        (log_every_n_steps, per_example_max_examples, headroom, min_batch_size, max_batch_size, batch_multiple_of,
         price_per_device_hour, summary_every_n_epochs, adapt_factor, adapt_patience, max_devices,
         measure_every_n_steps) = map(args.builtin, (
            log_every_n_steps, per_example_max_examples, headroom, min_batch_size, max_batch_size, batch_multiple_of,
            price_per_device_hour, summary_every_n_epochs, adapt_factor, adapt_patience, max_devices,
            measure_every_n_steps))
        self.method = method
        self.ema_decay = float(ema_decay)
        self.confidence = float(confidence)
        self.loss_reduction = loss_reduction
        self.log_every_n_steps = log_every_n_steps
        self.report_path = report_path
        self.verbose = verbose
        self.per_example_max_examples = per_example_max_examples
        self.measure_every_n_steps = measure_every_n_steps
        self.data_in_random_order = data_in_random_order
        self.draws_vary = draws_vary
        self.probe_enabled = probe
        self.memory_budget_bytes = None if memory_budget_bytes is None else int(memory_budget_bytes)
        self.headroom = headroom
        self.recommend_enabled = recommend
        self.recommend_options = {
            "min_batch_size": min_batch_size,
            "max_batch_size": max_batch_size,
            "multiple_of": batch_multiple_of,
            "power_of_two": power_of_two,
            "lr_rule": lr_rule,
            "price_per_device_hour": price_per_device_hour,
            "objective": objective,
            "max_devices": max_devices,
        }
        self.summary_every_n_epochs = summary_every_n_epochs
        self.adapt = adapt
        self.adapt_factor, self.adapt_patience = adapt_factor, adapt_patience
        self.sharpness_enabled = sharpness
        self.meter: Optional[GradientNoiseScaleMeter] = None
        self._state_key: Optional[str] = None
        self._new_fit()

    # ------------------------------------------------------------------ state
    def _new_fit(self) -> None:
        """Forget the last fit (a fresh fit starts from zero; a restore then loads the checkpoint's state)."""
        if self.meter is not None:
            self.meter.detach()
        self.meter = None
        self.resolved_method: Optional[str] = None
        self._restored: Optional[dict[str, Any]] = None
        self._history: list[dict[str, Any]] = []
        self._batch_size: Optional[int] = None  # the current micro-batch's size (None: unknown)
        self._sizes: list[Optional[int]] = []  # sizes of the current optimizer step's backward passes
        self._losses: list[Any] = []  # and their losses (device tensors)
        self._stepping: Optional[int] = None  # the global step whose first closure evaluation was measured
        self._started = False  # the first training batch has been seen (or a checkpoint restored past it)
        self._rows_read_checked = False  # :meth:`_rows_read_not_examples` has compared a step's examples
        self._probe_waits = False  # the probe waits for a later batch (_passes_wait)
        self._micro_batch_size: Optional[int] = None  # the first training batch's size (per device; None: unknown)
        self._base_lr: Optional[float] = None
        self._draw_watch: Optional[RandomDrawWatch] = None  # the first step's, where it may show the draws varying
        self._sampled_loader: Any = None  # the training DataLoader whose sampler gave the meter's population
        self._fit_report_path: Optional[str] = None
        self._adapter = Adapter(self.adapt_factor, self.adapt_patience) if self.adapt else None
        self.sharpness_monitor = (SharpnessMonitor(lr_rule=self.recommend_options["lr_rule"])
                                  if self.sharpness_enabled and self.recommend_enabled else None)
        self.probe_result: Optional[ProbeResult] = None
        self.recommendation: Optional[Recommendation] = None

    @property
    def state_key(self) -> str:
        # Lightning reads this at every hook call: build the string once.
        if self._state_key is None:
            self._state_key = self._generate_state_key(method=self.method, ema_decay=self.ema_decay)
        return self._state_key

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "meter": self.meter.state_dict() if self.meter is not None else self._restored,
            "history": list(self._history),
            "micro_batch_size": self._micro_batch_size,
            "base_lr": self._base_lr,
            "adapter": self._adapter.state_dict() if self._adapter is not None else None,
            "probe": self.probe_result.to_dict() if self.probe_result is not None else None,
            "sharpness": self.sharpness_monitor.state_dict() if self.sharpness_monitor is not None else None,
        }

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """Say so where the checkpoint holds this callback's state under another ``state_key`` (a resume with another
        ``method=`` or ``ema_decay=``): Lightning then skips it, and the estimate restarts at the resumed step. Before,
        only Lightning's generic "add the following callbacks" warning told: a run resumed at step 15 of 40 with
        ``ema_decay`` changed read 26.3 over 25 steps where the run of 40 read 30.5, with no word of the 15 left out."""
        states = checkpoint.get("callbacks") or {}
        prefix = type(self).__qualname__ + "{"
        others = [key for key in states if isinstance(key, str) and key.startswith(prefix) and key != self.state_key]
        if not others or self.state_key in states:
            return
        meter = (states[others[0]] or {}).get("meter") or {}
        _warn_rank_zero(trainer,
            f"GradientNoiseScaleCallback: the checkpoint's noise-scale sums ({meter.get('steps_seen', 0)} measured "
            f"steps) were measured with {others[0][len(prefix) - 1:]}, this run has "
            f"{self.state_key[len(prefix) - 1:]}: they are not restored, and the estimate restarts from this step. "
            f"To continue them, resume with the checkpoint's arguments."
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Restored before on_fit_start builds the meter: kept until then.
        self._restored = state_dict["meter"]
        self._history = list(state_dict.get("history", []))
        self._micro_batch_size = state_dict.get("micro_batch_size")
        self._base_lr = state_dict.get("base_lr")
        self._started = self._micro_batch_size is not None or self._base_lr is not None
        if self._adapter is not None and state_dict.get("adapter"):
            self._adapter.load_state_dict(state_dict["adapter"])
        if state_dict.get("probe"):
            self.probe_result = ProbeResult.from_dict(state_dict["probe"])
        if self.sharpness_monitor is not None and state_dict.get("sharpness"):
            self.sharpness_monitor.load_state_dict(state_dict["sharpness"])

    # ------------------------------------------------------------------ results
    @property
    def estimate(self) -> GNSEstimate:
        """The recent estimate (it tracks a moving run) with its interval; one device sync."""
        return self._meter_for_reading().estimate

    @property
    def run_estimate(self) -> GNSEstimate:
        """The run-average estimate (all measured steps weighted equally); one device sync."""
        return self._meter_for_reading().run_estimate

    @property
    def probe(self) -> Optional[ProbeResult]:
        """The hardware probe's result after the first training batch (``probe=True``), else None."""
        return self.probe_result

    @property
    def history(self) -> list[dict[str, Any]]:
        """The estimate at each logging point (and at fit end, ``"final": True``)."""
        return list(self._history)

    @property
    def coverage(self) -> dict[str, Any]:
        """Measured vs trainable parameters, and why the rest is left out (after fit start)."""
        return self.meter.coverage if self.meter is not None else {}

    @property
    def adaptations(self) -> list[dict[str, Any]]:
        """Every change ``adapt=True`` made, in order."""
        return list(self._adapter.events) if self._adapter is not None else []

    def _meter_for_reading(self) -> GradientNoiseScaleMeter:
        if self.meter is not None:
            return self.meter
        meter = GradientNoiseScaleMeter(_EMPTY_MODEL, "micro_batch", self.ema_decay, self.confidence)
        meter.looks_for_loaders = False  # the training sampler is read at fit start (_read_sampling)
        if self._restored:
            meter.load_state_dict(self._restored)
        return meter

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self._new_fit()
            self._refuse_unsupported(trainer, pl_module)  # before the strategy wraps (or shards) the model

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._fit_report_path = self._resolve_report_path(trainer)  # on every rank: log_dir is a collective
        self._refuse_unworkable(trainer)
        if self._adapter is not None:
            self._adapter.resume(trainer)
        # BatchNorm's mode is judged at the first batch: Lightning puts the module in train mode as each epoch
        # starts, and a module that freezes its BatchNorm does so in its own on_train_epoch_start, after this.
        self.meter = self._build_meter(trainer, pl_module, batch_norm=False)
        self.meter.attach()

    def _refuse_unworkable(self, trainer: Any) -> None:
        """Refuse, before any step, what would fail or mislead only later: a report path that can't be written
        (checked on every rank, so that all of them stop), and a setup ``adapt=True`` can't apply its decisions to."""
        problem = args.report_path_problem(self._fit_report_path)
        if problem is not None:
            raise misconfiguration(trainer,
                f"GradientNoiseScaleCallback: the report can't be written to {self._fit_report_path!r}: the path must "
                f"be {problem}. Pass report_path='<a writable file>.json'."
            )
        problem = self._adapter.unsupported(trainer) if self._adapter is not None else None
        if problem is not None:
            raise misconfiguration(trainer, f"GradientNoiseScaleCallback(adapt=True): {problem}")

    def _refuse_unsupported(self, trainer: Any, pl_module: Any) -> None:
        """Refuse a fit that would be measured wrong, saying what works instead, with an error of ``trainer``'s
        namespace (:mod:`gns_callback.lightning.supported`); warn for a strategy nobody has checked."""
        problem = supported.refusal(trainer, pl_module, adapt=self.adapt)
        if problem is not None:
            raise misconfiguration(trainer, problem)
        warning = supported.unverified_strategy_warning(trainer)
        if warning is not None:
            _warn_rank_zero(trainer, warning)

    def _build_meter(self, trainer: Any, pl_module: Any, batch_norm: bool) -> GradientNoiseScaleMeter:
        try:
            choice = choose_method(self.method, pl_module, several_micro_batches=facts.several_micro_batches(trainer),
                                   compiled=facts.compiled_whole(pl_module), batch_norm=batch_norm)
        except UnmeasurableSetup as error:
            raise misconfiguration(trainer, f"GradientNoiseScaleCallback: {error}") from None
        if choice.note and self.verbose:
            facts.say(trainer, f"GradientNoiseScaleCallback: {choice.note}")
        meter = GradientNoiseScaleMeter(
            pl_module, choice.method, self.ema_decay, self.confidence, self.loss_reduction,
            self.per_example_max_examples, reduce=facts.sum_across_ranks(trainer), fallback_method=choice.fallback,
            measure_every_n_steps=self.measure_every_n_steps,
        )
        meter.looks_for_loaders = False  # the training sampler is read at fit start (_read_sampling)
        if self._restored:
            meter.load_state_dict(self._restored)  # resumes the checkpoint's switch, or says it measured otherwise
        self.resolved_method = meter.method
        return meter

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._read_sampling(trainer, pl_module)  # on a resumed fit too: the sampler is not part of the checkpoint

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._detach()
        self._write_interrupted_report(trainer, exception)

    def _write_interrupted_report(self, trainer: Any, exception: BaseException) -> None:
        """The report of the steps measured before the fit stopped on ``exception`` (Ctrl-C, an error in the user's
        code), from rank zero, with ``run.interrupted`` saying why; no collective (other ranks may be gone), and a
        failure to write only warns. Before, an interrupted fit wrote no report: its measured steps were lost, and
        ``python -m gns_callback report`` found nothing to read. A fit refused before its first step writes none."""
        if self.meter is None or self.meter.steps_offered == 0 or not trainer.is_global_zero:
            return
        try:
            self._close_interrupted(trainer)
            sections = self.report_sections(trainer)
            sections["run"]["interrupted"] = f"{type(exception).__name__}: {exception}".removesuffix(": ")
            write_report(self.resolve_report_path(trainer), sections)
        except Exception as error:  # noqa: BLE001 - the user's own exception is the one to see
            _warn_rank_zero(trainer, f"GradientNoiseScaleCallback: could not write the report of the interrupted fit "
                                     f"({type(error).__name__}: {error}).")

    def _close_interrupted(self, trainer: Any) -> None:
        """What fit end adds, for an interrupted fit's report: the history's final point (not logged: the loggers
        may be gone) and the recommendation from the steps measured. Before, such a report held neither, and the
        report command drew no history and said only "no recommendation in the report"."""
        est, run = self.meter.read()
        if est.steps or est.failure is not None:
            self._history.append(_history_entry(trainer.global_step, est, run, final=True))
        if self.recommend_enabled:
            self.recommendation = self._recommend(trainer, self._batch_target())

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._detach()

    def _detach(self) -> None:
        if self.meter is not None:
            self.meter.detach()

    # ------------------------------------------------------------------ per batch and step
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._next_micro_batch(batch_size_of(batch))
        if not self._started:
            self._start_measuring(trainer, pl_module, batch, batch_idx)
        elif self.meter.needs_check or self._probe_waits:
            self._check_again(trainer, pl_module, batch, batch_idx)
        if self.sharpness_monitor is not None:
            self.sharpness_monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx, quiet=self.meter.paused)
        if self._draw_watch is not None:
            self._draw_watch.start()  # last: the probe and the sharpness monitor put their draws back

    def _next_micro_batch(self, size: Optional[int]) -> None:
        """Its size (None: unknown), for the per-example hooks before its forward pass, and for the step's window
        once its backward pass runs (``training_step`` may return None: then none does)."""
        self._batch_size = size
        self.meter.expect_batch_size(size)

    def _start_measuring(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._started = True
        problem = supported.combined_loaders_refusal(trainer) or supported.same_batches_refusal(trainer, batch)
        if problem is not None:
            raise misconfiguration(trainer, problem)
        self._settle_method(trainer, pl_module)
        self._micro_batch_size = self._batch_size
        self._base_lr = facts.base_lr(trainer)
        if self._micro_batch_size is None:
            return self._say_size_unknown(trainer)
        if self._passes_wait(trainer):
            self.meter.needs_check = self.meter.method == "per_example"  # on a later batch (_check_again)
            self._probe_waits = True
            return
        check_first_batch(self.meter, trainer, pl_module, batch, batch_idx, self._micro_batch_size)
        if self._rows_not_examples(trainer):
            return
        if self._probe_wanted(trainer) and self.probe_result is None:
            self._run_probe(trainer, pl_module, batch)

    def _rows_not_examples(self, trainer: Any) -> bool:
        """Stop measuring where the first batch's rows are not the DataLoader's examples
        (:func:`~gns_callback.lightning.supported.rows_not_examples`), unless the check already found a sequence-first
        batch (its own stop says so). Whatever else the check found, this is the reason: ``auto`` would switch to
        ``micro_batch`` on a refusal that one fixes, and ``micro_batch`` reads each micro-batch's size off the same
        rows. Before, a disjoint union of graphs (node rows) at 2 micro-batches of 16 graphs read B_simple = 1709.2
        (95% CI 1404.2–inf) against an exact 155.3 that way, and a model of node logits pooled per graph was told
        its loss was "scaled by the batch" (``tests/trust/test_graph_models.py``)."""
        check = self.meter.per_example_check
        problem = supported.rows_not_examples(trainer, self._micro_batch_size)
        if problem is None or (check is not None and check.status == SIZE_MISREAD):
            return False
        self.meter.stop(problem)
        return True

    def _rows_read_not_examples(self, trainer: Any) -> None:
        """Where the first batch's size could not be read off its tensors, per-example norms read it off their layers'
        rows: at the first step that read any, those are compared with the DataLoader's ``batch_size`` as the first
        batch's rows are (:meth:`_rows_not_examples`), and measuring stops where they differ. Before, a disjoint
        union of graphs in an object with attributes (PyTorch Geometric's ``Batch``) through a model whose every
        layer runs on nodes (the head on each node, its logits pooled per graph) read B_simple = 25.3 (95% CI
        22.5–29.4) against an exact 155.3, each node taken for an example (``tests/trust/test_graph_models.py``)."""
        rows = self.meter.examples_per_pass
        if rows is None or self.meter.method != "per_example":
            return
        self._rows_read_checked = True
        problem = supported.rows_not_examples(trainer, round(rows), read_off="layers")
        if problem is not None:
            self.meter.stop(problem)

    def _passes_wait(self, trainer: Any) -> bool:
        """Whether passes of the training step aside from the run (the check, the probe) must wait for a later batch:
        under DDP with ``static_graph=True`` before this fit's first optimizer step, where they would stop DDP's
        gradient sync for the rest of the run (:func:`~gns_callback.probe.lightning.ddp_static_graph`). Before, the
        ranks of a digits MLP trained apart (different weights after one epoch) and each read its own B_simple,
        27.4 and 29.2 against an exact 68.0. The first measured step checks its own sums meanwhile."""
        return self._stepping is None and ddp_static_graph(trainer)

    def _check_again(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """The first batch's check on this batch: for parameters the meter measures since its last step (a backbone
        unfrozen for fine-tuning), whose layers may add a gradient part no example carries, or couple the examples;
        or because the check could not run on the batch before (``training_step`` returned None to skip it, or it
        waited for DDP's first iteration: :meth:`_passes_wait`), with the probe where that waited too."""
        if self._passes_wait(trainer):
            return
        self.meter.needs_check = False
        if self._micro_batch_size is not None:
            check_first_batch(self.meter, trainer, pl_module, batch, batch_idx, self._micro_batch_size)
        if self._probe_waits and self._probe_wanted(trainer) and self.probe_result is None:
            self._run_probe(trainer, pl_module, batch)
        self._probe_waits = False

    def _settle_method(self, trainer: Any, pl_module: Any) -> None:
        """The method again, with BatchNorm in the mode of the first step (it couples the examples in training
        mode): ``micro_batch`` where the run allows it, else refused, before the first step."""
        if self.meter.method != "per_example" or per_example_problem(pl_module, batch_norm=True)[0] is None:
            return
        population, draws_vary, reason = self.meter.population, self.meter.draws_vary, self.meter.draws_vary_reason
        self.meter.detach()
        self.meter = self._build_meter(trainer, pl_module, batch_norm=True)
        self.meter.population, self.meter.draws_vary, self.meter.draws_vary_reason = population, draws_vary, reason
        self.meter.attach()
        self.meter.expect_batch_size(self._batch_size)

    def _read_sampling(self, trainer: Any, pl_module: Any) -> None:
        """The examples each epoch's batches are drawn from without replacement, corrected for, and whether their
        draws may vary (:mod:`gns_callback.sampling`). Batches not drawn at random at all are refused, before the
        first step."""
        population, problem = self._population(trainer)
        if problem is not None:
            raise misconfiguration(trainer, f"GradientNoiseScaleCallback cannot measure this run: "
                                            f"{_unshuffled_problem(trainer, problem)}")
        self._sampled_loader = getattr(trainer, "train_dataloader", None)
        unknown = unknown_draws(self._sampled_loader)
        if unknown is not None and not self.data_in_random_order:
            raise misconfiguration(trainer, f"GradientNoiseScaleCallback cannot measure this run: {unknown}; "
                                            f"{UNKNOWN_DRAWS}. {_UNKNOWN_DRAWS_FIX}")
        if unknown is not None:
            population = self._stated_random_draws(trainer)
        self.meter.population = population
        seen = draws_may_vary(self._sampled_loader, pl_module)
        if unknown is not None and population is not None:
            seen = seen or _EPOCH_UNKNOWN.format(population=population)
        self.meter.set_draws_vary(self.draws_vary, seen)
        # Fixed data and no dropout module: the step may still draw random numbers by functions of its own.
        fixed = population is not None and not self.meter.draws_vary
        self._draw_watch = RandomDrawWatch(pl_module) if fixed else None

    def _stated_random_draws(self, trainer: Any) -> Optional[int]:
        """A loader whose batches can't be told to be random draws (:func:`~gns_callback.sampling.unknown_draws`:
        refused, unless ``data_in_random_order=True`` says they are): the examples they may be drawn from without
        replacement, the data set's length on one process (None: several, each drawing apart, or no length),
        corrected for with the uncorrected upper end kept, which holds draws with replacement too
        (:func:`~gns_callback.sampling.varying_draws_high`). Before, such batches were measured as independent draws
        with nothing said: on wine (exact 4.01) batches of one class each read 1.06 [1.02, 1.11]; a stream shuffled
        anew each epoch, 4.19 [4.03, 4.36] (``benchmarks/samplers.py``)."""
        if trainer.world_size > 1:
            return None
        try:
            return len(self._sampled_loader.dataset)
        except TypeError:
            _warn_rank_zero(trainer,
                "GradientNoiseScaleCallback: data_in_random_order=True, but the training data set has no length, so "
                "its batches are measured as draws with replacement. If each epoch streams its N examples once in a "
                "new order, B_simple reads high by up to the fraction B_simple/N (on wine, N = 178: 4.19 [4.03, "
                "4.36] against an exact 4.01). Give the data set a __len__ returning N for the correction.")
            return None

    def _population(self, trainer: Any) -> tuple[Optional[int], Optional[str]]:
        """:func:`~gns_callback.sampling.population_of` the training DataLoader's sampler."""
        return population_of(facts.train_sampler(trainer), trainer.world_size, in_random_order=self.data_in_random_order)

    def _see_draws(self) -> None:
        """Whether the first training step drew random numbers before its backward pass
        (:mod:`gns_callback.random_streams`): then its examples' gradients vary between draws."""
        drawn = self._draw_watch.stop()
        if drawn is None:
            return  # no batch start seen (a backward pass outside a training batch)
        self._draw_watch = None
        if drawn:
            self.meter.set_draws_vary(None, drawn_reason(drawn))

    def _say_size_unknown(self, trainer: Any) -> None:
        if self._probe_wanted(trainer) or self.recommend_enabled:
            _warn_rank_zero(trainer,
                "GradientNoiseScaleCallback: the micro-batch size could not be read off the first training batch (no "
                "tensor in it, or tensors whose leading dims disagree with no majority), so no probe is run and no "
                "batch size is recommended. Let the DataLoader yield tensors with the batch as dim 0."
            )

    def _probe_wanted(self, trainer: Any) -> bool:
        """``probe`` as given, or for ``None``: on an accelerator, or for an objective that needs step times."""
        if self.probe_enabled is not None:
            return self.probe_enabled
        return facts.on_accelerator(trainer) or self.recommend_options["objective"] != BALANCED

    def _run_probe(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """Probe on every rank (they agree through one min all-reduce); our own hooks must not see it."""
        from gns_callback.probe import probe_trainer

        bar = self.verbose and facts.progress_bar_enabled(trainer)
        if self.verbose and not bar:
            facts.say(trainer, "GradientNoiseScaleCallback: probing memory and throughput per micro-batch size...")
        with self.meter.paused():
            self.probe_result = probe_trainer(
                trainer, pl_module, batch, memory_budget_bytes=self.memory_budget_bytes, headroom=self.headroom,
                # Throughput where the decision is made: the current micro-batch and its doublings (the probe adds
                # the largest size that fits).
                throughput_sizes=[self._micro_batch_size * 2**k for k in range(6)], progress_bar=bar,
                batch_size=self._micro_batch_size,
            )
        if self.verbose:
            facts.say(trainer, f"GradientNoiseScaleCallback: {self.probe_result.summary()}")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._draw_watch is not None:
            self._see_draws()
        self._sizes.append(self._batch_size)
        self._losses.append(loss.detach())  # the critical batch reads the noise scale against the loss

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Lightning zeroes the gradients before the first backward pass of each step. Passes recorded since the last
        measured step are zeroed with them, unread by any optimizer step: a module's ``optimizer_step`` that runs the
        closure alone to skip a step (Lightning's docs show it for alternating updates). Only the next step's own
        passes count. Before, they were read as micro-batches of the next step: skipping one step in 4 on the digits
        MLP read B_simple = 117 (95% CI 98–146) against an exact 67, one in 2 read it unbounded."""
        if self._sizes and self.meter is not None:
            self._drop_pending()

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.meter is not None:
            self.meter.enabled = False  # validation with gradients on is not a training step

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.meter is not None:
            self.meter.enabled = True  # (what the step recorded before validation is kept)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == self._stepping:
            return self._skip_reevaluation()
        self._stepping = trainer.global_step
        if self._adapter is not None:
            self._adapter.advance(trainer)
            self._warn_adapter_notices(trainer)
        sizes, self._sizes = self._sizes, []
        losses, self._losses = self._losses, []
        if self.meter.steps_offered == 0:
            self._stop_if_uncleared(pl_module, optimizer)
        scale = facts.loss_scale(trainer)
        self.meter.step(micro_batch_size=sizes, loss_scale=scale, loss_divisor=trainer.accumulate_grad_batches,
                        loss=_unscaled(_mean(losses), scale))
        if self._micro_batch_size is None and not self._rows_read_checked:
            self._rows_read_not_examples(trainer)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if every and (trainer.global_step + 1) % every == 0:
            self._log(trainer, pl_module)

    def _skip_reevaluation(self) -> None:
        """The optimizer evaluates its closure again within the same step (LBFGS's line search): its parameters now
        depend on the batch, whose ``|G_B|²`` they have driven down, so only the step's first evaluation counts."""
        self._drop_pending()

    def _drop_pending(self) -> None:
        """Forget the backward passes recorded since the last measured step: no step reads their gradients."""
        self._sizes, self._losses = [], []
        self.meter.discard_pending()

    def _stop_if_uncleared(self, pl_module: Any, optimizer: Any) -> None:
        """At the first step: stop measuring if gradients accumulate that the optimizer never clears
        (:func:`~gns_callback.grad_watch.uncleared_gradients`); the same on every rank."""
        problem = uncleared_gradients(pl_module, optimizer)
        if problem is not None:
            self.meter.stop(problem)

    # ------------------------------------------------------------------ logging
    def _log(self, trainer: Any, pl_module: Any, final: bool = False) -> None:
        """One point of history and one row in every logger, at the callback's own interval."""
        if final and self._history and self._history[-1]["step"] == trainer.global_step:
            self._history[-1]["final"] = True  # the last logging point was the last step
            return
        est, run = self.meter.read()
        if est.steps == 0 and est.failure is None:
            return
        self._history.append(_history_entry(trainer.global_step + (0 if final else 1), est, run, final))
        metrics = {**_estimate_metrics(est, run), **self._recommendation_metrics(trainer)}
        _log_metrics(trainer, metrics, step=trainer.global_step - (1 if final else 0))

    def _recommendation_metrics(self, trainer: Any) -> dict[str, float]:
        rec = self._recommend(trainer, self._batch_target()) if self.recommend_enabled else None
        if rec is None:
            return {}
        metrics = {
            "gns/recommended_batch_size": float(rec.batch_size),
            "gns/recommended_micro_batch_size": float(rec.micro_batch_size),
            "gns/recommended_accumulate_grad_batches": float(rec.accumulate_grad_batches),
        }
        if rec.learning_rate is not None:
            metrics["gns/recommended_lr"] = float(rec.learning_rate)
        return metrics

    # ------------------------------------------------------------------ recommendation and adaptation
    def _batch_target(self) -> dict[str, Any]:
        """What a fixed batch size aims at: the run's critical batch (:mod:`gns_callback.critical_batch`), in the
        shape ``recommend()`` reads an estimate."""
        return critical_batch_target(self.meter.critical_batch)

    def _recommend(self, trainer: Any, estimate: Any) -> Optional[Recommendation]:
        """The recommendation for this run from ``estimate`` (pure; the same on every rank)."""
        if self._micro_batch_size is None or not trainer.optimizers:
            return None
        accumulate, world = trainer.accumulate_grad_batches, trainer.world_size
        multiplier = self._adapter.lr_multiplier if self._adapter is not None else 1.0
        coverage = self.meter.coverage  # one read: it sums the parameters' sizes
        current_lr = None if self._base_lr is None else self._base_lr * multiplier
        rec = recommend(
            estimate,
            current_batch_size=self._micro_batch_size * accumulate * world,
            current_lr=current_lr,
            optimizer=trainer.optimizers[0],
            num_devices=world,
            current_micro_batch_size=self._micro_batch_size,
            current_accumulate=accumulate,
            probe=self.probe_result,
            sharpness=None if self.sharpness_monitor is None else self.sharpness_monitor.largest,
            dataset_size=facts.dataset_size(trainer),
            steps_per_epoch=facts.steps_per_epoch(trainer),
            coverage=coverage.get("fraction", 1.0),
            left_out_share=coverage.get("left_out_gradient_share") or 0.0,
            **self.recommend_options,
        )
        rec = _with_schedule_note(rec, facts.peak_lr_schedule(trainer), current_lr)
        return _with_groups_note(rec, facts.group_base_lrs(trainer), current_lr)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._follow_reloaded_loader(trainer)
        if self._adapter is not None and trainer.current_epoch > 0 and self._micro_batch_size is not None:
            self._adapt(trainer)

    def _follow_reloaded_loader(self, trainer: Any) -> None:
        """A training DataLoader reloaded for this epoch (``reload_dataloaders_every_n_epochs``) may draw from
        another number of examples: the steps from now on are corrected for its (:mod:`gns_callback.sampling`).
        Before, the first loader's stood for the whole run: a curriculum of 96 examples, then all 1,400 of digits,
        read 39.8 [36.8, 43.2] against an exact 67.0. A reloaded loader that does not shuffle stops the measurement,
        with the reason; the run goes on."""
        loader = getattr(trainer, "train_dataloader", None)
        if self.meter is None or loader is self._sampled_loader:
            return
        self._sampled_loader = loader
        population, problem = self._population(trainer)
        if problem is not None:
            return self.meter.stop(f"the training DataLoader reloaded for epoch {trainer.current_epoch}: {problem}. "
                                   "Pass shuffle=True to it")
        unknown = unknown_draws(loader)
        if unknown is not None and not self.data_in_random_order:
            return self.meter.stop(f"the training DataLoader reloaded for epoch {trainer.current_epoch}: {unknown}; "
                                   f"{UNKNOWN_DRAWS}. {_UNKNOWN_DRAWS_FIX}")
        self.meter.population = population if unknown is None else self._stated_random_draws(trainer)

    def _adapt(self, trainer: Any) -> None:
        """Adaptation aims where the recommendation does: the run's critical batch so far. (Following the recent
        noise scale instead, which grows as the loss falls, overshot: 3.2× the examples to the target on the diabetes
        regression, against 1.4×; benchmarks/RESULTS.md, "Adapting the batch during training".)"""
        rec = self._recommend(trainer, self._batch_target())
        if rec is None:
            return
        event = self._adapter.consider(trainer, rec, self._micro_batch_size, facts.steps_per_epoch(trainer),
                                       self.meter.method)
        self._warn_adapter_notices(trainer)
        if event is not None:
            self._announce_adaptation(trainer, event)

    def _warn_adapter_notices(self, trainer: Any) -> None:
        """What adapt could not do (:attr:`Adapter.notices`), each warned once."""
        while self._adapter.notices:
            _warn_rank_zero(trainer, self._adapter.notices.pop(0))

    def _announce_adaptation(self, trainer: Any, event: dict[str, Any]) -> None:
        old, new = event["accumulate_grad_batches"]
        _log_metrics(trainer, {"gns/adapt_accumulate_grad_batches": float(new),
                               "gns/adapt_lr_factor": float(self._adapter.ramp["target"] if self._adapter.ramp
                                                            else self._adapter.lr_multiplier)},
                     step=trainer.global_step)
        facts.say(trainer,
            f"GradientNoiseScaleCallback(adapt=True): epoch {event['epoch']}: accumulate_grad_batches {old} → {new} "
            f"(global batch {event['batch_size']}); LR ×{event['lr_factor']:.3g} ({event['lr_rule']} rule) over "
            f"{event['warmup_steps']} warmup steps. {event['reason']}"
        )

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        every = self.summary_every_n_epochs
        if self.recommend_enabled and every and (trainer.current_epoch + 1) % every == 0:
            rec = self._recommend(trainer, self._batch_target())
            if rec is not None:
                facts.say(trainer, f"GradientNoiseScaleCallback, epoch {trainer.current_epoch}:\n{rec.summary_table()}")

    # ------------------------------------------------------------------ end of fit
    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._detach()
        self.meter.settle()  # every rank: agree on a problem one of them found since the last agreement
        self._log(trainer, pl_module, final=True)
        est, run = self.meter.read()
        if self.recommend_enabled:
            self.recommendation = self._recommend(trainer, self._batch_target())
        if trainer.is_global_zero:
            self._write_final_report(trainer)
        if self.verbose:
            self._print_summary(trainer, est)

    def _write_final_report(self, trainer: Any) -> None:
        """The report at fit end; a failure to write it (disk full, a value JSON can't hold, ...) warns instead of
        failing the finished run."""
        try:
            self.write_report(trainer)
        except Exception as error:  # noqa: BLE001 - the finished run must not fail for its report
            _warn_rank_zero(trainer, f"GradientNoiseScaleCallback: could not write the report to "
                                     f"{self._fit_report_path!r} ({type(error).__name__}: {error}); the estimates are "
                                     "in cb.estimate and cb.run_estimate.")

    def _calibration(self, trainer: Any) -> str:
        """How far the critical batch is calibrated for this run's optimizer (:mod:`~gns_callback.recommendation.
        calibration`)."""
        reason = uncalibrated_reason(trainer.optimizers[0]) if trainer.optimizers else "no optimizer"
        return reason or CALIBRATED

    def _print_summary(self, trainer: Any, est: GNSEstimate) -> None:
        facts.say(trainer, f"GradientNoiseScaleCallback: {est}\n  {self.meter.critical_batch}\n"
                           f"  calibration: {self._calibration(trainer)}\n  report: {self._fit_report_path}")
        fraction = self.meter.coverage.get("fraction", 1.0)
        if fraction < MIN_COVERAGE and est.failure is None:
            facts.say(trainer, f"GradientNoiseScaleCallback: B_simple is that of {fraction:.1%} of the trainable "
                               "parameters (see the report's 'coverage').")
        if self.meter.population is not None and self.meter.draws_vary and est.failure is None:
            facts.say(trainer, f"GradientNoiseScaleCallback: the interval's upper end makes room for examples that "
                               f"vary between draws ({self.meter.draws_vary_reason}) on shuffled epochs of "
                               f"{self.meter.population} examples; draws_vary=False says they don't.")
        if self.recommendation is not None:
            facts.say(trainer, self.recommendation.summary_table())
        if est.steps and est.failure is None and not math.isfinite(est.ci_high):
            facts.say(trainer,
                "GradientNoiseScaleCallback: the interval is unbounded: |G|² is not resolved from the noise yet; "
                "train longer or measure over more steps before trusting B_simple."
            )

    def _resolve_report_path(self, trainer: Any) -> str:
        if self.report_path is not None:
            return str(self.report_path)
        return os.path.join(trainer.log_dir or trainer.default_root_dir, DEFAULT_REPORT_NAME)

    @property
    def report_file(self) -> Optional[str]:
        """Where the current (or last) fit writes its report; ``report_path`` itself is never changed."""
        return self._fit_report_path

    def resolve_report_path(self, trainer: Any) -> str:
        """Where this fit's report goes (``report_path``, else ``<trainer.log_dir>/gns_report.json``)."""
        return self._fit_report_path or self._resolve_report_path(trainer)

    def report_sections(self, trainer: Any) -> dict[str, Any]:
        """The report's content."""
        est, run = self.meter.read()
        check = self.meter.per_example_check
        return {
            "estimate": est.to_dict(),
            "run_estimate": run.to_dict(),
            "critical_batch": {**self.meter.critical_batch.to_dict(), "calibration": self._calibration(trainer)},
            "batch_target": json_safe(self._batch_target()),  # what the recommendation aimed at (report command)
            "history": self._history,
            "recommendation": self.recommendation.to_dict() if self.recommendation is not None else None,
            "probe": self.probe_result.to_dict() if self.probe_result is not None else None,
            "adaptations": self.adaptations,
            "coverage": self.meter.coverage,
            "per_example_check": check.to_dict() if check is not None else None,
            "config": {
                "method": self.method,
                "ema_decay": self.ema_decay,
                "confidence": self.confidence,
                "loss_reduction": self.loss_reduction,
                "loss_reduction_found": getattr(self.meter, "loss_reduction_found", None),
                "per_example_max_examples": self.per_example_max_examples,
                "measure_every_n_steps": self.measure_every_n_steps,
                "recommend_options": dict(self.recommend_options),
            },
            "run": {
                "world_size": trainer.world_size,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "precision": str(trainer.precision),
                "global_step": trainer.global_step,
                "dataset_size": facts.dataset_size(trainer),
                "steps_per_epoch": facts.steps_per_epoch(trainer),
                "drawn_without_replacement_from": self.meter.population,
                "draws_vary": self.meter.draws_vary,
                "draws_vary_reason": self.meter.draws_vary_reason,
            },
        }

    def write_report(self, trainer: Any) -> str:
        path = self.resolve_report_path(trainer)
        write_report(path, self.report_sections(trainer))
        return path


_OWNER = "GradientNoiseScaleCallback"
_POSITIVE_INT = args.optional(args.int_at_least(1))
_ARGUMENTS: dict[str, args.Rule] = {
    **METER_ARGUMENTS,  # ema_decay, confidence, loss_reduction, per_example_max_examples, measure_every_n_steps
    "method": args.Rule(args.one_of(*METHODS), "one of 'auto', 'micro_batch', 'per_example', e.g. 'auto'"),
    "log_every_n_steps": args.Rule(_POSITIVE_INT, "a positive int, e.g. 50, or None to follow the Trainer"),
    "report_path": args.Rule(lambda v: v is None or args.report_path_problem(v) is None,
                             lambda v: f"{args.report_path_problem(v)}, or None for <trainer.log_dir>/gns_report.json"),
    "verbose": args.Rule(args.is_bool, "True or False"),
    "probe": args.Rule(args.optional(args.is_bool), "True, False, or None (on for an accelerator)"),
    "memory_budget_bytes": args.Rule(args.optional(args.whole_bytes),
                                     "a positive whole number of bytes, e.g. 8 * 2**30 for 8 GiB, or None for the "
                                     "device's memory"),
    "headroom": args.Rule(args.number_in(0, 1, low_open=True), "a number in (0, 1], e.g. 0.85"),
    "recommend": args.Rule(args.is_bool, "True or False"),
    "min_batch_size": args.Rule(_POSITIVE_INT, "a positive int, e.g. 16, or None for no lower bound"),
    "max_batch_size": args.Rule(_POSITIVE_INT, "a positive int, e.g. 4096, or None for no upper bound"),
    "batch_multiple_of": args.Rule(args.int_at_least(1), "a positive int, e.g. 8"),
    "power_of_two": args.Rule(args.is_bool, "True or False"),
    "lr_rule": args.Rule(args.one_of(None, *LR_RULES),
                         "one of " + ", ".join(map(repr, LR_RULES)) + ", or None to choose by optimizer family "
                         "('noise_linear' for SGD, 'noise_sqrt' for Adam)"),
    "price_per_device_hour": args.Rule(args.optional(args.number_in(0, math.inf, high_open=True)),
                                       "a number ≥ 0, e.g. 2.5 (your currency per device-hour), or None"),
    "summary_every_n_epochs": args.Rule(_POSITIVE_INT, "a positive int, e.g. 1, or None for no periodic summary"),
    "adapt": args.Rule(args.is_bool, "True or False"),
    "data_in_random_order": args.Rule(args.is_bool, "True or False"),
    "adapt_factor": args.Rule(args.number_in(1, math.inf, low_open=True, high_open=True),
                              "a number > 1, e.g. 1.5 (no change while the recommended batch is within ×1.5)"),
    "adapt_patience": args.Rule(args.int_at_least(1), "a positive int, e.g. 2 (consecutive epochs)"),
    "sharpness": args.Rule(args.is_bool, "True or False"),
    "objective": args.Rule(args.one_of(*OBJECTIVES), "one of " + ", ".join(map(repr, OBJECTIVES)) + ", e.g. "
                           "'balanced' (the knee) or 'time' (with probe=True)"),
    "max_devices": args.Rule(_POSITIVE_INT, "a positive int, e.g. 8, or None to keep the run's device count"),
}


def _check_arguments(values: dict[str, Any]) -> None:
    """Every constructor argument against :data:`_ARGUMENTS`, then the rules that tie two of them together."""
    args.check_arguments(_OWNER, values, _ARGUMENTS)
    low, high = values["min_batch_size"], values["max_batch_size"]
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"{_OWNER}(min_batch_size={low!r}, max_batch_size={high!r}): min_batch_size must not exceed "
            "max_batch_size, e.g. min_batch_size=16, max_batch_size=4096."
        )
    if values["objective"] != BALANCED and values["probe"] is False:
        raise ValueError(
            f"{_OWNER}(objective={values['objective']!r}, probe=False): {values['objective']!r} is chosen from the "
            "probe's measured step time per micro-batch; set probe=True, or objective='balanced'."
        )
    if values["adapt"] and values["max_devices"] is not None:
        raise ValueError(f"{_OWNER}(adapt=True, max_devices={values['max_devices']!r}): adapt changes only "
                         "accumulate_grad_batches during a run, not the device count; drop one of them.")
    if values["adapt"] and not values["recommend"]:
        raise ValueError(f"{_OWNER}(adapt=True, recommend=False): adapt applies the recommendation; "
                         "set recommend=True or adapt=False.")
    _check_recommend_options_used(values)


#: The arguments that shape the recommendation alone: with ``recommend=False`` they do nothing.
_RECOMMENDATION_ONLY = ("min_batch_size", "max_batch_size", "batch_multiple_of", "power_of_two", "price_per_device_hour",
                        "objective", "max_devices")


def _check_recommend_options_used(values: dict[str, Any]) -> None:
    """``recommend=False`` with an argument that only shapes the recommendation set to another value than its
    default: a ``ValueError`` naming them. Before, they did nothing, without a word (``objective='time'`` still ran a
    probe for a plan no one would see)."""
    defaults = inspect.signature(GradientNoiseScaleCallback.__init__).parameters
    unused = [f"{name}={values[name]!r}" for name in _RECOMMENDATION_ONLY if values[name] != defaults[name].default]
    if not values["recommend"] and unused:
        raise ValueError(f"{_OWNER}(recommend=False, {', '.join(unused)}): these shape the recommended batch, which "
                         "recommend=False turns off; set recommend=True, or drop them.")


_EMPTY_MODEL = torch.nn.Module()  # what a meter reads from before fit (or after a restore, before fit start)


def _unshuffled_problem(trainer: Any, problem: str) -> str:
    """The training DataLoader does not shuffle: ``problem``, and what to do. Under ``overfit_batches`` Lightning
    itself reads the same few batches in order (it replaces the user's shuffling sampler), so shuffle=True is no fix
    there."""
    overfit = getattr(trainer, "overfit_batches", 0)
    if overfit:
        return (f"Trainer(overfit_batches={overfit!r}) trains on the same batches every epoch, read in order whatever "
                "the DataLoader's shuffle, while the noise scale assumes batches drawn at random. Remove the callback "
                "from overfitting runs, or set overfit_batches=0.")
    return (f"{problem}. Pass shuffle=True to the training DataLoader; or, if the data set is in a random order "
            "already (shuffled or drawn beforehand) and must be read in order, "
            "GradientNoiseScaleCallback(data_in_random_order=True).")


def _with_groups_note(rec: Recommendation, lrs: list[float], current_lr: Optional[float]) -> Recommendation:
    """``rec`` with a note on scaling each param group's LR where the groups run at different LRs."""
    if rec.learning_rate is None or not current_lr:
        return rec
    note = param_groups_note(lrs, rec.learning_rate / current_lr)
    return rec if note is None else dataclasses.replace(rec, notes=(*rec.notes, note))


def _with_schedule_note(rec: Recommendation, schedule: Optional[tuple[str, list[float]]],
                        current_lr: Optional[float]) -> Recommendation:
    """``rec`` with a note on scaling the peaks of a schedule that sets the LR itself (OneCycleLR, CyclicLR)."""
    if schedule is None or rec.learning_rate is None or not current_lr:
        return rec
    note = peak_schedule_note(*schedule, rec.learning_rate / current_lr)
    return rec if note is None else dataclasses.replace(rec, notes=(*rec.notes, note))


def _mean(losses: list[Any]) -> Optional[torch.Tensor]:
    if len(losses) == 1:  # the mean of one (the usual step without accumulation), without three tensor ops
        return losses[0].float().reshape(())
    return torch.stack([loss.float().reshape(()) for loss in losses]).mean() if losses else None


def _unscaled(loss: Optional[torch.Tensor], scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The step's loss without the AMP GradScaler's scale, which ``on_before_backward`` receives it multiplied by
    (the scale is the same through a step: the scaler updates it after the optimizer step). Before, the critical
    batch read the scaled loss, whose fall at each halving of the scale (a step the scaler skips) looked like
    training progress: 82 skipped steps at fixed parameters on digits read "loss 1.23e+06 → 4.77e+05" and a
    B_crit of 63.5 from loss windows, where the run average read 76.4."""
    if loss is None or scale is None:
        return loss
    return loss / scale.to(device=loss.device, dtype=loss.dtype)


def _history_entry(step: int, est: GNSEstimate, run: GNSEstimate, final: bool) -> dict[str, Any]:
    entry = {"step": step, "b_simple": est.b_simple, "ci_low": est.ci_low, "ci_high": est.ci_high,
             "b_simple_run": run.b_simple, "run_ci_low": run.ci_low, "run_ci_high": run.ci_high}
    if final:
        entry["final"] = True
    return json_safe(entry)


def _estimate_metrics(est: GNSEstimate, run: GNSEstimate) -> dict[str, float]:
    return {
        "gns/b_simple": est.b_simple,
        "gns/grad_sq_norm": est.grad_sq_norm,
        "gns/trace_sigma": est.trace_sigma,
        "gns/b_simple_ci_low": est.ci_low,
        "gns/b_simple_ci_high": est.ci_high,
        "gns/b_simple_run": run.b_simple,
    }


def _log_metrics(trainer: Any, metrics: dict[str, float], step: int) -> None:
    """Straight to every logger at ``step`` (not through ``self.log``, which follows the Trainer's interval),
    and into ``trainer.callback_metrics`` (for checkpoint monitors and progress bars)."""
    for name, value in metrics.items():
        trainer.callback_metrics[name] = torch.tensor(value)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _warn_rank_zero(trainer: Any, message: str) -> None:
    if trainer.is_global_zero:
        warnings.warn(message, stacklevel=3)
