"""``GradientNoiseScaleMeter``: the measurement engine, for any PyTorch training loop (no Lightning).

It owns everything between a gradient and a number: the collector's hooks (:mod:`gns_callback.collectors`),
each step's window of small-batch norms (:mod:`gns_callback.accumulation`), the step's unbiased ``tr(Σ)`` and
``|G|²`` (:mod:`gns_callback.estimators`), the recent estimate that follows a moving run
(:mod:`gns_callback.tracking`), the run average and intervals (:mod:`gns_callback.smoothing`), and checkpoint
state. A gradient's path: hook → collector (per pass) → :meth:`step` (window → step estimates → recent estimate
and run average) → :attr:`estimate`. The Lightning callback only tells it what Lightning knows.

Use::

    with GradientNoiseScaleMeter(model, method="per_example") as meter:
        for x, y in loader:
            loss_fn(model(x), y).backward()
            meter.step()                       # after the step's backward pass(es), before zero_grad
            optimizer.step(); optimizer.zero_grad()
    print(meter.estimate)

With ``method="micro_batch"`` each optimizer step runs several backward passes (gradient accumulation, each loss
divided by their count) and ``meter.step(micro_batch_size=b)`` says how many examples each pass saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from types import FrameType, TracebackType
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn
from torch.utils.data import DataLoader

from gns_callback import arguments as args
from gns_callback.batch_size import batch_size_of, first_half_copied, rows_taken
from gns_callback.accumulation import (PACKED_FIELDS, SCALE_MARGIN, AccumulationWindow, LossReduction, scale_mismatch,
                                      step_estimates)
from gns_callback.backward_passes import hooks_inert, measurement_paused
from gns_callback.blend import PairBlend
from gns_callback.collectors import (BATCH_NORM_COUPLES, COLLECTORS, MIN_COVERAGE, Collector, coverage_warning,
                                     synced_batch_norm_problem, synced_batch_norms)
from gns_callback.critical_batch import CriticalBatchAccumulator, CriticalBatchEstimate
from gns_callback.deferred import DeferredReads
from gns_callback.estimate import GNSEstimate
from gns_callback.grad_watch import (CLEARED as GRADIENTS_CLEARED, STALE, GradientWatch, RankOwnGradient,
                                     StaleGradients, Verdict, world_size)
from gns_callback.left_out import LeftOutShare
from gns_callback.loss_reduction import reduction_of, reduction_reason
from gns_callback.norms import squared_norm_sum
from gns_callback.overflows import OverflowCount
from gns_callback.own_hooks import remove_inert_hooks
from gns_callback.per_example.checks import (NO_METHOD, SUMS_CHECKED, PerExampleCheck, check_loss_divisor,
                                             check_per_example, first_step_check)
from gns_callback.per_example import compiled
from gns_callback.per_example.tracker import MICRO_BATCH_HINT, MISREAD_BATCH_SIZE
from gns_callback.per_example.sketch import reseed_probes
from gns_callback.per_example.sum_check import SumCheck
from gns_callback.probe.attributes import describe
from gns_callback.probe.state import preserved_state
from gns_callback.random_streams import StepDrawWatch, caller_frames, drawn_reason, scope_generators, scope_objects
from gns_callback.sampling import (draws_may_vary, population_from, unstated_population, varying_draws_high,
                                   without_replacement)
from gns_callback.scalar_ops import host_errors_ignored
from gns_callback.smoothing import RatioAccumulator, RatioSummary, step_values, summarize_ratio
from gns_callback.tracking import LocalLinearRatio

SCALES_DIFFER = (
    "the step's mean gradient read {ratio:.3g}× the mean squared norm of its examples' (or micro-batches') gradients, "
    "which a mean never exceeds: the two were read on different scales. With AMP, pass loss_scale= only once the "
    "gradients are unscaled (scaler.unscale_(optimizer) before meter.step()), or pass no loss_scale while they "
    "are still scaled"
)
LOSS_REDUCTIONS = ("mean", "sum")
NOT_ATTACHED = (
    "meter.step() was called on a GradientNoiseScaleMeter whose hooks were never put on, so nothing can be "
    "measured. Use `with GradientNoiseScaleMeter(model) as meter:` around the loop, or call meter.attach() before "
    "the first backward pass"
)
_BATCH_NORM_PROBLEM = (f"{BATCH_NORM_COUPLES}: the noise scale read from them would be wrong. Instead, "
                       f"{MICRO_BATCH_HINT}, or normalise without batch statistics (GroupNorm, LayerNorm)")
#: Why ``micro_batch``'s check of the loss's divisor is left out for a compiled model: the check's pass under the
#: loss watch (a ``TorchFunctionMode``) would make ``torch.compile`` trace the step a second time.
_COMPILED_NOT_CHECKED = "the loss's divisor is not checked on a compiled model (the check would compile its step again)"
MEASURING_METHODS = tuple(COLLECTORS)
#: Steps between checks that the model's trainable parameters are still the ones measured (unfreezing a backbone
#: for fine-tuning changes them); each check walks the parameter list once.
TRAINABLE_CHECK_EVERY = 50
#: Batches on which :meth:`GradientNoiseScaleMeter.check_per_example` is tried before "not checked" stands (a batch
#: the loop skips, ``training_step`` returning None, has no pass to check; a failed try costs about one forward pass).
CHECK_TRIES = 8
#: Frames above :meth:`GradientNoiseScaleMeter.step` whose generators the watch of the loop's draws reads (the loop,
#: and a helper or two it calls step() through).
LOOP_FRAMES = 3
#: 3: the recent estimate is a :class:`~gns_callback.tracking.LocalLinearRatio` (2: an EMA of the parts, which
#: cannot be converted: a version-2 state resumes everything else, and the recent estimate restarts).
STATE_VERSION = 3

#: With several ranks, whether one of them found a step unmeasurable travels inside the step's all-reduce; the host
#: reads it (one device sync) at the first ``AGREE_FIRST`` steps, then every ``AGREE_EVERY`` steps and at
#: :meth:`GradientNoiseScaleMeter.settle`, so that all ranks stop or switch method at the same step. Steps after
#: such a finding are left out on the device until then.
AGREE_FIRST, AGREE_EVERY = 8, 32

#: The arguments shared with the Lightning callback, checked by :func:`gns_callback.arguments.check_arguments`.
ARGUMENTS: dict[str, args.Rule] = {
    "ema_decay": args.Rule(args.number_in(0, 1, high_open=True),
                           "a number in [0, 1), e.g. 0.99 to average over roughly the last 200 steps"),
    "confidence": args.Rule(args.number_in(0, 1, low_open=True, high_open=True), "a number in (0, 1), e.g. 0.95"),
    "loss_reduction": args.Rule(args.one_of(*LOSS_REDUCTIONS),
                                "'mean' (the loss is averaged over the batch, Lightning's convention) or 'sum'"),
    "per_example_max_examples": args.Rule(args.optional(args.int_at_least(2)),
                                          "an int ≥ 2, e.g. 16, or None to measure every example of each batch"),
    "measure_every_n_steps": args.Rule(args.int_at_least(1),
                                       "an int ≥ 1, e.g. 1 to measure every optimizer step or 4 for one in four"),
    "draws_vary": args.Rule(args.optional(args.is_bool),
                            "None (told from the data set and the model), True where an example's gradient differs "
                            "from one draw to the next (data augmentation, dropout), or False where it never does"),
}
_METHOD = args.Rule(args.one_of(*MEASURING_METHODS), "one of 'per_example', 'micro_batch', e.g. 'per_example'")
_FALLBACK = args.Rule(args.one_of(None, *MEASURING_METHODS), "None or 'micro_batch'")
_MODEL = args.Rule(lambda value: isinstance(value, nn.Module),
                   "a torch.nn.Module: the model whose trainable parameters are measured, e.g. "
                   "GradientNoiseScaleMeter(model) (under DDP the wrapped model or its .module)")
_REDUCE = args.Rule(lambda value: value is None or callable(value),
                    "None (one process), or a function that sums a float64 tensor over the data-parallel ranks, "
                    "e.g. gns_callback.meter.all_reduce_sum or lambda t: fabric.all_reduce(t, reduce_op='sum')")
_POPULATION = args.Rule(lambda value: value is None or isinstance(value, DataLoader) or args.int_at_least(2)(value),
                        "None (batches drawn with replacement, or a stream), or, when each epoch's batches are drawn "
                        "without replacement (DataLoader(shuffle=True)), the data set's size, e.g. len(dataset), or "
                        "the training DataLoader itself")

#: ``reduce(t) -> t`` summing a float64 tensor over data-parallel ranks (e.g. ``torch.distributed.all_reduce``).
SumAcrossRanks = Callable[[torch.Tensor], torch.Tensor]
BatchSizes = Union[int, Sequence[Optional[int]], None]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """A ``reduce`` for plain ``torch.distributed`` data parallelism: the sum over all ranks."""
    import torch.distributed as dist

    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


class GradientNoiseScaleMeter:
    """Measures ``B_simple = tr(Σ)/|G|²`` (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

    Args:
        model: the module whose trainable parameters are measured.
        method: ``"per_example"`` (per-example gradient norms inside each batch; not with BatchNorm in training
            mode) or ``"micro_batch"`` (each backward pass's gradient against the step's; needs several backward
            passes per step, or several data-parallel ranks).
        ema_decay: weight of the past in the recent estimate's base window, in ``[0, 1)`` (``0.99``: about the
            last 200 steps; :class:`~gns_callback.tracking.LocalLinearRatio`).
        confidence: level of the reported intervals, in ``(0, 1)``.
        loss_reduction: ``"mean"`` or ``"sum"``: what each backward pass's loss is over its batch.
            :meth:`check_batch` reads which it is and measures that one (``loss_reduction_found``; a warning where
            it differs from this).
        per_example_max_examples: ``per_example`` measures only this many examples of each batch where that is
            cheaper than every example (None: always all); ``|G|²`` then still uses every pair with a measured
            example (see the callback).
        reduce: sums a float64 tensor over data-parallel ranks (None: one process). With it, every rank must call
            :meth:`step` at every optimizer step: it runs one collective.
        fallback_method: the method to switch to, for the rest of the run, when the hooks find a step that
            ``method`` can't measure (``method="auto"`` in the callback: ``"micro_batch"`` where the run has several
            backward passes per step). None: stop measuring instead.
        population: the number of examples each epoch's batches are drawn from without replacement
            (``len(dataset)`` under ``DataLoader(shuffle=True)``), or the training DataLoader, whose sampler says
            it: the estimates then correct for it (:mod:`gns_callback.sampling`; left out, ``B_simple`` reads high by
            about ``B_simple/N``). None: batches drawn with replacement, or from a stream; where the loop that calls
            :meth:`step` nonetheless holds a DataLoader drawing without replacement, the first step takes its size,
            keeps the uncorrected upper end (as ``draws_vary`` does) and warns with the fix
            (:func:`~gns_callback.sampling.unstated_population`). The Lightning callback reads it off the training
            sampler.
        draws_vary: with ``population``, whether an example's gradient differs from one draw to the next (data
            augmentation as the data set loads it, dropout): the correction then may read ``B_simple`` low, by up to
            ``B_simple/N``, and the intervals' upper ends make room for it (:func:`~gns_callback.sampling.
            varying_draws_high`). None: True unless ``population`` is a DataLoader over a ``TensorDataset`` and the
            model has no dropout module (:func:`~gns_callback.sampling.draws_may_vary`), and, from the third
            :meth:`step` on, True also where the random streams moved between each of the first steps
            (:class:`~gns_callback.random_streams.StepDrawWatch`: ``F.dropout``, stochastic depth, noise).
            :attr:`draws_vary_reason` says why.
        measure_every_n_steps: measure one optimizer step in ``n`` (the first, then every ``n``-th): the hooks do
            nothing on the others, so the meter's cost per step falls about ``n``-fold, and the run average's
            standard error at a given number of optimizer steps grows about ``√n``-fold, more in short runs
            (benchmarks/RESULTS.md, "Accuracy against public peers"). ``ema_decay`` weighs *measured* steps: the
            recent estimate's window spans ``n`` times as many optimizer steps (with ``ema_decay**n`` per measured
            step instead, its window held a quarter of the steps at ``n = 4`` and read 0.37 mean |relative error| at
            fixed parameters, against 0.24). With ``reduce``, every rank rests on the same steps (no collective).

    Read :attr:`estimate` (recent: a local-linear fit of the ratio that follows a moving run,
    :mod:`gns_callback.tracking`) and :attr:`run_estimate` (every measured step weighted equally); each read copies
    the sums to the host once. Where per-example norms leave some trainable parameters out but measure at least
    ``MIN_COVERAGE`` of them, the intervals (and the critical batch's) widen to hold the whole model's value
    (:mod:`gns_callback.left_out`). If the hooks find the model unmeasurable mid-run (a module applied
    twice, a batch dim that can't be told, a gradient penalty reaching per-example hooks, a forward compiled by
    ``torch.compile``, which per-example hooks can't see, ...), the meter switches
    to ``fallback_method`` (warning once; the estimate restarts) or stops measuring: it warns once, and both
    estimates read "not measured" (NaN) with the reason in ``failure``. It never raises inside the user's backward
    pass. With ``per_example``, call :meth:`expect_batch_size` before each forward pass where you can: each layer's
    batch dim is then checked against it, and sequence-first layers (``(T, B, ...)`` inputs) are measured.
    """

    def __init__(
        self,
        model: nn.Module,
        method: str = "per_example",
        ema_decay: float = 0.99,
        confidence: float = 0.95,
        loss_reduction: LossReduction = "mean",
        per_example_max_examples: Optional[int] = 16,
        reduce: Optional[SumAcrossRanks] = None,
        fallback_method: Optional[str] = None,
        measure_every_n_steps: int = 1,
        population: Optional[int] = None,
        draws_vary: Optional[bool] = None,
    ) -> None:
        args.check_arguments("GradientNoiseScaleMeter", {
            "model": model, "method": method, "ema_decay": ema_decay, "confidence": confidence,
            "loss_reduction": loss_reduction, "per_example_max_examples": per_example_max_examples, "reduce": reduce,
            "fallback_method": fallback_method, "measure_every_n_steps": measure_every_n_steps,
            "population": population, "draws_vary": draws_vary,
        }, {**ARGUMENTS, "model": _MODEL, "method": _METHOD, "reduce": _REDUCE, "fallback_method": _FALLBACK,
            "population": _POPULATION})
        self.model = model
        self.method = method
        self.fallback_method = fallback_method if fallback_method != method else None
        self.switched_from: Optional[str] = None  # the method measured before a switch to the fallback
        self.ema_decay = float(ema_decay)
        self.confidence = float(confidence)
        self.loss_reduction: LossReduction = loss_reduction
        self.per_example_max_examples = args.builtin(per_example_max_examples)
        self.reduce = reduce
        self.measure_every_n_steps = int(measure_every_n_steps)
        self.population = population_from(args.builtin(population))  # examples each epoch's batches are drawn from
        #: Whether an example's gradient may differ between draws (see ``draws_vary``): widens the upper ends.
        self.draws_vary = False
        self.draws_vary_reason: Optional[str] = None  # why they may (None: shown fixed, so far)
        self.set_draws_vary(draws_vary, draws_may_vary(population, model))
        # Shown fixed by the data and the modules: the loop's own steps may still draw random numbers.
        self._step_draws = (StepDrawWatch(model) if draws_vary is None and self.population is not None
                            and not self.draws_vary else None)
        #: Whether the first :meth:`step` looks in the loop's scope for a shuffled DataLoader while ``population`` is
        #: None (:func:`~gns_callback.sampling.unstated_population`); the Lightning callback reads the sampler itself.
        self.looks_for_loaders = True
        self.collector: Collector = COLLECTORS[method](model, max_examples=per_example_max_examples)
        self._watch = GradientWatch([])  # the measured parameters, once attached
        self._stale: Optional[StaleGradients] = None  # the first steps' check for gradients left from before
        self._stale_steps = 0  # steps it found
        #: Without ``reduce``: whether a DDP of the loop's averages ``.grad`` over ranks (the first steps, once attached)
        self._own: Optional[RankOwnGradient] = None
        self._trainable: tuple[int, ...] = ()  # ids of the trainable parameters when the hooks went on
        self._unreadable = False  # the last step's norms could not be read (:meth:`_collect`)
        self._synced_norms: Optional[tuple[nn.Module, ...]] = None  # SyncBatchNorm layers, found at the first check
        self.examples_per_pass: Optional[float] = None  # the last step's mean examples per backward pass, as read
        #: Set when the measured parameters changed, or a check could not run: run :meth:`check_per_example` again
        #: before the next step.
        self.needs_check = False
        self._check_tries = 0  # checks in a row that failed to run (:meth:`_check_failed`)
        self._coverage_said = False  # the partial coverage warned of (:meth:`_say_coverage`)
        self._size_doubt_said = False  # micro_batch sizes given that the model's input doesn't show (said once)
        self._said_not_restored = False  # the checks' passes left state that could not be put back (said once)
        self._attached = False
        self._ever_attached = False  # step() before any attach() is a call-order mistake (:data:`NOT_ATTACHED`)
        self._widens_for_left_out = False  # set by attach()
        self._enabled = True
        self.steps_offered = 0  # every call to step(), measured or resting: the duty cycle's phase
        self.per_example_check: Optional[PerExampleCheck] = None  # :meth:`check_per_example`'s outcome
        #: What :meth:`check_batch` found the loss to be over the batch ("mean", "sum"; None: not found).
        self.loss_reduction_found: Optional[str] = None
        reseed_probes(0)  # sketched norms draw their probes per step (per_example/sketch.py)
        self.reset()

    # ------------------------------------------------------------------ hooks on / off
    def attach(self) -> "GradientNoiseScaleMeter":
        """Put the hooks on (idempotent)."""
        self.collector.attach()
        self.collector.call_at_pass_end(self._backward_ended)
        # Below MIN_COVERAGE the estimate is said to be the covered parameters' (a warning says so); above it, the
        # whole model's, so its interval makes room for the parameters left out (:mod:`gns_callback.left_out`).
        self._widens_for_left_out = self.collector.coverage().fraction >= MIN_COVERAGE
        self._say_coverage()
        self._watch = GradientWatch(self.collector.measured_parameters(), self._left_out_parameters(),
                                    read_at_mark=self.reduce is None)
        self._remove_pass_watches()
        self._stale = (StaleGradients(self._watch.params[0], same_tensor=self.reduce is None) if self._watch.params
                       else None)  # the smallest
        self._own = RankOwnGradient(self._watch.params[0]) if self._watch.params and self.reduce is None else None
        self._set_hooks()
        self._trainable = _trainable_ids(self.model)
        self._attached = self._ever_attached = True
        self._arm_sum_check(self.per_example_check is None or self.per_example_check.status == SUMS_CHECKED)
        return self

    def _say_coverage(self) -> None:
        """Warn once where the hooks cover less than ``MIN_COVERAGE`` of the trainable parameters
        (:func:`~gns_callback.collectors.coverage_warning`): the estimate is then the covered parameters' own."""
        warning = None if self._coverage_said else coverage_warning(self.collector)
        if warning is not None:
            self._coverage_said = True
            warnings.warn(f"gns_callback: {warning}", stacklevel=3)

    def _arm_sum_check(self, armed: bool) -> None:
        """Where :meth:`check_per_example` has not run, the first measured step's passes are checked on their own:
        each parameter's gradient must be its layers' summed per-example gradients (check 1 of
        :mod:`gns_callback.per_example.checks`; one more weight gradient per layer, once). Without it, a parameter
        also used outside its layer (``h @ embedding.weight.T``) or an L2 term in the loss reached ``|G_B|²`` but no
        example's norm, and the interval knew nothing of it."""
        tracker = self._per_example_tracker()
        if tracker is not None:
            tracker.sum_check = SumCheck(keep_tensors=False) if armed else None

    def _per_example_tracker(self) -> Any:
        """The ``per_example`` collector's hook tracker; None for another method's collector."""
        return getattr(self.collector, "tracker", None)

    def detach(self) -> None:
        """Take every hook off (and the inert copies of them that a copy of the model held in it carries)."""
        self.collector.detach()
        remove_inert_hooks(self.model)
        self._remove_pass_watches()
        self._attached = False

    def _pass_watches(self) -> list[Union[StaleGradients, RankOwnGradient]]:
        """The first steps' watches on one parameter's ``.grad`` that are on (each pass's end told to both)."""
        return [watch for watch in (self._stale, self._own) if watch is not None]

    def _remove_pass_watches(self) -> None:
        for watch in self._pass_watches():
            watch.remove()
        self._stale = self._own = None

    @property
    def enabled(self) -> bool:
        """Whether the hooks may record (False: inert, e.g. during validation with gradients on). They also rest
        on the steps ``measure_every_n_steps`` skips (:attr:`measures_next_step`)."""
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)
        self._set_hooks()

    def _set_hooks(self) -> None:
        """The collector records only when enabled and on a step the meter measures; the check of the steps' passes
        (:class:`~gns_callback.grad_watch.StaleGradients`) only when enabled."""
        self.collector.enabled = self._enabled and self.measures_next_step
        for watch in self._pass_watches():
            watch.enabled = self._enabled

    @property
    def measures_next_step(self) -> bool:
        """Whether the optimizer step now under way is one the meter measures (``measure_every_n_steps``)."""
        return self.steps_offered % self.measure_every_n_steps == 0

    def _rest_or_resume(self) -> None:
        """Count a step, and set the hooks for the next one (recording only on the steps measured)."""
        self.steps_offered += 1
        reseed_probes(self.steps_offered)
        self._set_hooks()

    def set_draws_vary(self, given: Optional[bool], seen: Optional[str] = None) -> None:
        """``draws_vary`` as given, else as ``seen`` says (why the draws may vary; None: they don't)."""
        if given is None:
            self.draws_vary, self.draws_vary_reason = seen is not None, seen
        else:
            self.draws_vary, self.draws_vary_reason = bool(given), f"draws_vary={given} given"

    def _watch_step_draws(self, loop: list[FrameType]) -> None:
        """Whether the loop's steps draw random numbers of their own (:class:`~gns_callback.random_streams.
        StepDrawWatch`), over the first steps; ``loop``: the frames that called :meth:`step`, whose generators are
        read too (:func:`~gns_callback.random_streams.scope_generators`)."""
        drawn = self._step_draws.tick(scope_generators(loop))
        if drawn is not None:
            self._step_draws = None
            if drawn:
                self.set_draws_vary(None, drawn_reason(drawn))

    def backward_done(self) -> None:
        """Backward has ended, and nothing has changed the gradients yet: :meth:`step` then checks that nothing did
        before it reads them (:mod:`gns_callback.grad_watch`). The meter marks this itself as each backward pass
        that fills ``.grad`` ends (after DDP's reduction); calling it again before anything changes them is
        harmless."""
        if self._enabled and self.measures_next_step and self.failure is None:
            self._watch.mark()

    def _backward_ended(self) -> None:
        """A backward pass of the step ended (the collector's ledger calls this); passes aside from the run don't
        count (:func:`~gns_callback.backward_passes.measurement_paused`)."""
        if not hooks_inert():
            self.backward_done()
            for watch in self._pass_watches():
                watch.pass_ended()

    def expect_batch_size(self, size: Optional[int]) -> None:
        """The number of examples in the micro-batch whose forward pass runs next (None: unknown).

        ``per_example`` checks each layer's batch dim against it and measures ``(T, B, ...)`` inputs along dim 1;
        without it, dim 0 is taken and checked only against ``micro_batch_size`` at :meth:`step`."""
        self.collector.expect_batch_size(size)

    def __enter__(self) -> "GradientNoiseScaleMeter":
        return self.attach()

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.detach()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hooks inert inside (forward/backward passes that are not training steps), and what they left dropped; every
        other meter's too (:func:`~gns_callback.backward_passes.measurement_paused`)."""
        was = self.enabled
        self.enabled = False
        try:
            with measurement_paused():
                yield
        finally:
            self.enabled = was
            self.discard_pending()

    def check_batch(self, loss_of: Callable[[Any], torch.Tensor], batch: Any, batch_size: Optional[int] = None,
                    **preserve: Any) -> PerExampleCheck:
        """:meth:`check_per_example` on ``batch``, with every pass built from it, as the Lightning callback runs it:
        ``loss_of(batch)`` is the step's loss on a batch (``lambda b: loss_fn(model(b[0]), b[1])``), run on the batch
        itself and on its copies with the second half's rows from the first half's and from the first row
        (:func:`~gns_callback.batch_size.first_half_copied`), so that mixing in the loop (mixup), a statistic of the
        labels (``pos_weight`` from the batch's counts) and a divisor made from them (a mask over its own sum) are
        seen. ``batch_size``: the examples in ``batch``, where the batch doesn't show them in dim 0 of its tensors."""
        size = batch_size or batch_size_of(batch)
        if size is None:
            raise ValueError("GradientNoiseScaleMeter.check_batch(batch_size=None): the batch's size can't be read off "
                             "its tensors; pass it, e.g. check_batch(loss_of, batch, batch_size=len(x))")
        # The copies only where per-example norms are checked (micro_batch's check runs the batch alone); the one
        # from the first row only when its pass runs (where the halves' copy reads independent).
        halves, copied = first_half_copied(batch, size) if self.method == "per_example" else (None, False)

        def run_pass() -> None:
            loss_of(batch).backward()

        def run_replaced_pass() -> None:
            loss_of(halves).backward()

        def run_first_row_pass() -> None:
            loss_of(first_half_copied(batch, size, from_first_row=True)[0]).backward()

        outcome = self.check_per_example(run_pass, size, run_replaced_pass if copied else None,
                                         run_first_row_pass if copied else None, **preserve)
        if not outcome.refused and self.loss_reduction_found is None:
            self._find_loss_reduction(loss_of, batch, size, preserve)
        return outcome

    def _find_loss_reduction(self, loss_of: Callable[[Any], torch.Tensor], batch: Any, size: int,
                             preserve: dict[str, Any]) -> None:
        """Whether the loss is a mean or a sum over the batch (:mod:`gns_callback.loss_reduction`): two more passes,
        on the batch's first ``h`` rows and on them twice, in eval mode (dropout draws no masks), everything put
        back. One that reads other than ``loss_reduction`` replaces it, with a warning: a step's passes of unequal
        sizes are weighed by it. Where neither reads (another divisor, a penalty on the parameters, a pass that
        fails), ``loss_reduction`` stands."""
        half = size // 2
        if self.failure is not None or half < 1 or compiled.compiled_modules(self.model):
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        rows = torch.arange(half)

        def gradients(index: torch.Tensor) -> list[Optional[torch.Tensor]]:
            taken, changed = rows_taken(batch, size, index)
            if not changed:
                raise LookupError("no tensor of the batch holds its examples in dim 0")
            for param in params:
                param.grad = None
            loss_of(taken).backward()
            return [None if p.grad is None else p.grad.detach().clone() for p in params]

        try:
            with self.paused(), preserved_state(self.model, [], **preserve) as state:
                self.model.eval()
                once = gradients(rows)
                state.restore()
                self.model.eval()
                twice = gradients(torch.cat([rows, rows]))
        except Exception:  # noqa: BLE001 - not found: loss_reduction stands, and the run goes on
            return
        self.loss_reduction_found = reduction_of(once, twice)
        found = self.loss_reduction_found
        if found is not None and found != self.loss_reduction:
            warnings.warn(f"gns_callback: {reduction_reason(found, self.loss_reduction, half)}.", stacklevel=3)
            self.loss_reduction = found  # type: ignore[assignment]

    def check_per_example(self, run_pass: Callable[[], None], batch_size: int,
                          run_replaced_pass: Optional[Callable[[], None]] = None,
                          run_first_row_pass: Optional[Callable[[], None]] = None, **preserve: Any) -> PerExampleCheck:
        """Whether ``per_example`` can measure this model and loss (:mod:`gns_callback.per_example.checks`): each
        parameter's gradient is the sum of its layers' per-example gradients (an L2 term in the loss breaks that),
        and the examples of a batch reach the loss independently (an in-batch contrastive loss breaks that).

        ``run_pass()`` runs one forward and backward of a batch of ``batch_size`` examples, as a training step
        does; it runs two or three times, with the hooks paused, from the same state, and everything the passes
        touch is put back (``preserve``: what :func:`~gns_callback.probe.state.preserved_state` takes besides the
        model). A failed check makes the next :meth:`step` switch to ``fallback_method`` or stop measuring, with the
        reason, as any step the hooks can't measure does. Call it once before the first step (the Lightning callback
        does, on the first batch). It never raises: a check that fails to run is "not checked", with the error.

        ``run_replaced_pass``, if given, runs the same pass on the batch with its second half's rows copied from the
        first (:func:`gns_callback.batch_size.first_half_copied`), e.g. ``lambda: loss_fn(model(xc), yc).backward()``
        with ``(xc, yc), _ = first_half_copied((x, y), len(x))``: then mixing the examples in the loop before the
        model (mixup) is caught too. ``run_first_row_pass``, with it: the same on the batch whose second half's rows
        are all copies of its first row, ``first_half_copied((x, y), len(x), from_first_row=True)``, which moves a
        statistic of the labels that the first copy can leave as it was (``pos_weight`` = the batch's negatives over
        its positives, where the halves hold as many positives). Without them, rows are copied at the model's first
        measured layer (where the labels are not).

        With ``method="micro_batch"`` it runs ``run_pass()`` once, for the loss's divisor alone
        (:func:`~gns_callback.per_example.checks.check_loss_divisor`): a mean over the batch's class weights or its
        targets not ignored, a ratio at any micro-batch's size, stops the measurement."""
        if self.failure is not None:
            return PerExampleCheck("not checked", detail=f"method={self.method!r}")
        if self.method == "micro_batch":
            if compiled.compiled_modules(self.model):
                return PerExampleCheck("not checked", detail=_COMPILED_NOT_CHECKED)
            return self._run_check(lambda reset: check_loss_divisor(run_pass, batch_size, self.model), preserve)
        self._arm_sum_check(False)  # this check includes the first step's
        return self._run_check(lambda reset: check_per_example(self.model, run_pass, batch_size, reset=reset,
                                                               run_replaced_pass=run_replaced_pass,
                                                               run_first_row_pass=run_first_row_pass), preserve)

    def _run_check(self, check: Callable[[Callable[[], None]], PerExampleCheck],
                   preserve: dict[str, Any]) -> PerExampleCheck:
        """``check(reset)`` with the hooks paused and everything its passes touch put back (``reset`` puts it back
        between passes); its outcome kept, and a refusal made the next step's problem."""
        state = None
        try:
            with self.paused(), preserved_state(self.model, [], **preserve) as state:
                self.per_example_check = check(state.restore)
        except Exception as error:  # noqa: BLE001 - a check must never end the user's run
            self._check_failed(error)
        else:
            self._check_tries = 0
        if state is not None and state.not_restored and not self._said_not_restored:
            self._said_not_restored = True
            _warn_not_restored(state.not_restored)
        if self.per_example_check.refused:
            self._problem = self._problem or self.per_example_check.detail
        if self.per_example_check.status in NO_METHOD:
            self.fallback_method = None  # micro-batches of such a loss are ratios too: stop, don't switch
        return self.per_example_check

    def _check_failed(self, error: Exception) -> None:
        """A check that could not run (``training_step`` returned None to skip the batch, say): "not checked", tried
        again before the next step up to :data:`CHECK_TRIES` batches in a row, and meanwhile the first measured
        step's own sum check armed (it finds an L2 term or a parameter used outside its layer, though not coupled
        examples)."""
        self._check_tries += 1
        self.per_example_check = PerExampleCheck("not checked",
                                                 detail=f"the check failed: {type(error).__name__}: {error}")
        self.needs_check = self._check_tries < CHECK_TRIES
        self._arm_sum_check(True)

    def discard_pending(self) -> None:
        """Drop what the hooks recorded since the last :meth:`step` (e.g. a step that will not be taken), and the
        marks of its backward passes' ends."""
        self.collector.discard()
        self._watch.forget()
        for watch in self._pass_watches():
            watch.forget()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every measured step."""
        self.ema = LocalLinearRatio(self.ema_decay)
        self.run = RatioAccumulator(1.0)
        self.recent_from = 0  # measured steps before the recent estimate started (a version-2 state's)
        self.critical = CriticalBatchAccumulator()
        self.blend = PairBlend()  # per_example with a subset measured: weights of its two |G|² estimates
        self.left_out = LeftOutShare(self.ema_decay)  # the parameters left out's share of the step gradient
        self.overflows = OverflowCount()  # steps skipped for non-finite gradients, once one was finite
        self._may_say_overflows = True
        self._reads: DeferredReads[Union[_ReducedRow, _LocalRow]] = DeferredReads()  # steps on their way
        self.losses_given = False
        self.steps_seen = 0  # optimizer steps offered for measurement
        self._may_say_unmeasurable = True  # until a first step is seen (_say_unmeasurable)
        self.failure: Optional[str] = None
        self._problem: Optional[str] = None  # why this rank could not measure a step, until the ranks agree
        self._any_rank_failed: Optional[torch.Tensor] = None  # device bool, since the last agreement
        self._steps_across_ranks = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain types only (checkpoints load with ``weights_only=True``)."""
        self._apply_read()
        return {
            "version": STATE_VERSION,
            "method": self.method,
            "ema": self.ema.state_dict(),
            "recent_from": self.recent_from,
            "run": self.run.state_dict(),
            "critical": self.critical.state_dict(),
            "blend": self.blend.state_dict(),
            "left_out": self.left_out.state_dict(),
            "overflows": self.overflows.state_dict(),
            "losses_given": self.losses_given,
            "steps_seen": self.steps_seen,
            "steps_offered": self.steps_offered,
            "failure": self.failure,
            "switched_from": self.switched_from,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`. A version-2 state (an EMA of the parts as the recent estimate) resumes
        the run average and the critical batch exactly; the recent estimate starts afresh, because the tracker's
        sums (normalised steps, their trend moments) can't be rebuilt from the EMA's."""
        self._reads.clear()
        self._resume_method(state.get("method", self.method), state.get("switched_from"))
        self.run.load_state_dict(state["run"])
        if int(state.get("version", 1)) >= 3:
            self.ema.load_state_dict(state["ema"])
            self.recent_from = int(state.get("recent_from", 0))
            if self.ema.decay != self.ema_decay:
                warnings.warn(
                    f"gns_callback: the state's recent estimate was tracked with ema_decay={self.ema.decay}; it "
                    f"continues with that, not this meter's ema_decay={self.ema_decay}. Build the meter with "
                    f"ema_decay={self.ema.decay} to resume it, or start without the state.", stacklevel=2)
        else:
            self.ema = LocalLinearRatio(self.ema_decay)
            self.recent_from = round(float(self.run.sums[0]))
        if state.get("blend"):  # absent before this key existed: the blend restarts from an even weight
            self.blend.load_state_dict(state["blend"])
        if state.get("left_out"):  # absent before this key existed: nothing was left out, or it restarts
            self.left_out.load_state_dict(state["left_out"])
        if state.get("overflows"):  # absent before this key existed: counted afresh
            self.overflows.load_state_dict(state["overflows"])
        if state.get("critical"):
            self.critical.load_state_dict(state["critical"])
            self.losses_given = bool(state.get("losses_given"))
        self.steps_seen = int(state["steps_seen"])
        self.steps_offered = int(state.get("steps_offered", self.steps_seen))
        reseed_probes(self.steps_offered)
        self._set_hooks()  # the duty cycle's phase at the resumed step
        self.failure = state.get("failure")

    def _resume_method(self, method: str, switched_from: Optional[str]) -> None:
        """Measure with the state's method where the state's meter switched to this one's fallback (its hooks were
        found unreliable on this model: before, the resumed meter went back to them). A state measured with
        another method is continued with this meter's, with a warning: both methods' sums are unbiased for the
        same ``|G|²`` and ``tr(Σ)``, so the run average goes on from them."""
        if method == self.method:
            self.switched_from = switched_from
        elif method == self.fallback_method and switched_from == self.method:
            self._use_collector(method)
            self.switched_from, self.method, self.fallback_method = switched_from, method, None
            self.needs_check = False
        else:
            warnings.warn(
                f"gns_callback: the state was measured with method={method!r}; this meter measures with "
                f"method={self.method!r} from here on, and its run average goes on from the state's sums (both "
                f"methods estimate the same |G|² and tr(Σ)). Build the meter with method={method!r} to resume it "
                "as it was, or start without the state.", stacklevel=3)

    # ------------------------------------------------------------------ per optimizer step
    def step(
        self,
        micro_batch_size: BatchSizes = None,
        loss_scale: Union[torch.Tensor, float, None] = None,
        loss_divisor: Optional[float] = None,
        loss: Union[torch.Tensor, float, None] = None,
    ) -> None:
        """Measure the optimizer step whose backward pass(es) just ran; call before ``zero_grad``.

        Args:
            micro_batch_size: examples per backward pass (an int for all, or one per pass; None: unknown). Needed by
                ``micro_batch``; ``per_example`` reads sizes off its hooks and checks them against it if given.
            loss_scale: the AMP GradScaler's scale the backward passes ran with (the optimizer's ``.grad`` must
                be unscaled by now, as after ``scaler.unscale_(optimizer)``); None without a scaler.
            loss_divisor: what each backward pass's loss was divided by (None: the number of passes, as in
                ``(loss / accumulate).backward()``; Lightning: ``accumulate_grad_batches``).
            loss: the step's training loss (any constant factor is fine). With it, :attr:`critical_batch` reads the
                critical batch off the noise scale as a function of the loss; without it, that is the run average.
        """
        if not self._ever_attached:
            raise RuntimeError(NOT_ATTACHED)
        problem = _step_arguments_problem(micro_batch_size, loss_scale, loss_divisor)
        if problem is not None:
            micro_batch_size, loss_scale, loss_divisor = self._refuse_step_arguments(problem)
        self.overflows.scaled = self.overflows.scaled or loss_scale is not None
        if self.looks_for_loaders:
            self._say_unstated_population(caller_frames(LOOP_FRAMES))
        if self._step_draws is not None:
            self._watch_step_draws(caller_frames(LOOP_FRAMES))
        measured = self.measures_next_step
        self._rest_or_resume()
        if self._trainable_changed():
            return self._follow_trainable()
        stale = None if self._stale is None else self._stale.problem()
        averaged = None if self._own is None else self._own.problem()
        if self.failure is not None or not measured:
            return self.discard_pending()
        if averaged is not None:
            return self.stop(averaged)
        if stale is not None and self._stale_step(stale):
            return
        window = self._collect(_as_sizes(micro_batch_size), loss_divisor)
        if window.empty and self._unreadable_after_trainable_change():
            return self._follow_trainable()
        if not window.empty:
            self._read_sum_check(window)
            self._check_batch_norm_mode()
            self._check_synced_batch_norm()
        verdict = self._gradients_changed(loss_scale)
        if verdict.problem is not None and self.reduce is None:
            return self.stop(verdict.problem)
        if verdict.skip:
            return self._skip_step()
        if self.reduce is not None:
            return self._step_across_ranks(window, loss_scale, loss)
        if self._problem is not None:
            return self._give_up(self._problem)
        if window.empty:
            return
        self.steps_seen += 1
        if window.measurable(self.loss_reduction):
            self._measure(window, loss_scale, loss, verdict.totals)
        elif self._may_say_unmeasurable:
            self._say_unmeasurable(window)
        self._may_say_unmeasurable = False

    def _say_unstated_population(self, loop: list[FrameType]) -> None:
        """At the first step, once, where ``population`` was not given but the loop (``loop``: the frames that called
        :meth:`step`) holds a DataLoader that draws without replacement
        (:func:`~gns_callback.sampling.unstated_population`): correct for its examples with the uncorrected upper
        end kept (as where draws vary), which holds the value whether or not that loader feeds the steps, and warn
        with the fix. Before, a plain loop over a shuffled DataLoader read B_simple high by about B_simple/N with
        nothing said: 4.4 [4.3, 4.5] against an exact 4.2 on wine."""
        self.looks_for_loaders = False
        found = None if self.population is not None else unstated_population(
            scope_objects(loop, lambda value: isinstance(value, DataLoader)), world_size())
        if found is None:
            return
        self.population, problem = found
        if not self.draws_vary:
            self.draws_vary, self.draws_vary_reason = True, problem
        self._step_draws = None
        warnings.warn(f"gns_callback: {problem}", stacklevel=4)

    def _refuse_step_arguments(self, problem: str) -> tuple[None, None, None]:
        """A :meth:`step` argument of the wrong type or sign: a ``ValueError`` at the first step, before anything is
        measured; later (a value that went wrong mid-run) measuring stops with the reason, every rank at once under
        ``reduce``, and the step goes on without those arguments."""
        if self.steps_offered == 0:
            raise ValueError(problem)
        if self.reduce is None:
            self.stop(problem)
        else:
            self._problem = self._problem or problem
        return None, None, None

    def _read_sum_check(self, window: AccumulationWindow) -> None:
        """The first measured step's own checks (:meth:`_arm_sum_check`), once they could tell; BatchNorm in
        training mode is found here too (its batch statistics couple the examples). A refusal is a problem found at
        this step: the meter switches to ``fallback_method`` or stops, every rank at once."""
        tracker = self._per_example_tracker()
        sum_check = None if tracker is None else tracker.sum_check
        if sum_check is None:
            return
        if tracker.has_batchnorm_in_training():
            verdict = PerExampleCheck("coupled", detail=_BATCH_NORM_PROBLEM)
        else:
            verdict = first_step_check(sum_check, int(window.micro_size_sum) if window.micro_count == 1 else None)
        self._arm_sum_check(verdict is None and bool(sum_check.rests))  # a step that couldn't tell: the next one
        if verdict is None:
            return
        self.per_example_check = verdict
        if verdict.refused:
            self._problem = self._problem or verdict.detail

    def _check_batch_norm_mode(self) -> None:
        """Every measured step after the first (which :meth:`_read_sum_check` covers): a BatchNorm layer that went
        into training mode mid-run (one held in eval mode for the first epochs, then released) couples the
        examples from then on, so per-example norms stop being the examples' gradients. Before, on the digits MLP
        with a BatchNorm1d in eval mode for the first epoch, the next two epochs were measured with no warning. A
        problem found at this step: ``fallback_method`` or a stop, every rank at once."""
        tracker = self._per_example_tracker()
        if tracker is not None and tracker.sum_check is None and tracker.has_batchnorm_in_training():
            self._problem = self._problem or f"a BatchNorm layer went into training mode: {_BATCH_NORM_PROBLEM}"

    def _check_synced_batch_norm(self) -> None:
        """Every measured step with ``reduce`` (several data-parallel ranks): ``micro_batch`` reads each rank's
        gradient as an independent micro-batch's, which a ``SyncBatchNorm`` in training mode makes false
        (:data:`~gns_callback.collectors.SYNCED_BATCH_NORM_COUPLES`). Before, such a run was measured: simulated on
        one CPU (``benchmarks/synced_batch_norm.py``), the digits BatchNorm CNN on 2 ranks × 16 read 47.7 [44.6,
        51.3] against the step gradient's 33.4. A problem found at this step: a stop, every rank at once."""
        if self.method != "micro_batch" or self.reduce is None or self._problem is not None:
            return
        if self._synced_norms is None:
            self._synced_norms = synced_batch_norms(self.model)
        self._problem = synced_batch_norm_problem(self._synced_norms, several_ranks=True)

    def _trainable_changed(self) -> bool:
        """Every :data:`TRAINABLE_CHECK_EVERY` steps: whether the trainable parameters differ from those measured."""
        if not self._attached or self.failure is not None or self.steps_offered % TRAINABLE_CHECK_EVERY:
            return False
        return _trainable_ids(self.model) != self._trainable

    def _unreadable_after_trainable_change(self) -> bool:
        """Whether the step's norms could not be read (:meth:`_collect`) because the trainable parameters changed since
        the hooks went on, between two checks of :meth:`_trainable_changed`: a layer frozen mid-run whose output still
        gets a gradient (an earlier layer trains) gets none for its parameters. Then the new set is followed at once,
        as at a check. Before, measuring stopped for the rest of the run ("a measured layer's output received a
        gradient but its parameters none"), and its fix (``micro_batch``) was no fix. One process only: ranks follow
        a change together, at a check (they stop together on what they can't read)."""
        unreadable, self._unreadable = self._unreadable, False
        if not unreadable or self.reduce is not None or _trainable_ids(self.model) == self._trainable:
            return False
        self._problem = None
        return True

    def _follow_trainable(self) -> None:
        """Measure the model's trainable parameters as they are now, from the next step; the steps so far are
        forgotten (they measured the noise scale of another set of parameters: of the head alone, before a backbone
        was unfrozen, say). Every rank finds the change at the same step."""
        before, after = len(self._trainable), len(_trainable_ids(self.model))
        warnings.warn(
            f"gns_callback: the model's trainable parameters changed ({before} → {after} tensors, e.g. a backbone "
            "unfrozen for fine-tuning); the noise scale is now measured over the new set, and the estimate restarts "
            "from the next step", stacklevel=3)
        self.discard_pending()
        self._use_collector(self.method)
        self.needs_check = self.method == "per_example"
        self.reset()

    def _use_collector(self, method: str) -> None:
        """A fresh ``method`` collector over the model's trainable parameters as they are now, hooked as before."""
        self.collector.detach()
        self.collector = COLLECTORS[method](self.model, max_examples=self.per_example_max_examples)
        self._set_hooks()  # the new collector takes the pause and the duty cycle as they are
        if self._attached:
            self.attach()

    def _stale_step(self, reason: str) -> bool:
        """A step whose first pass found a gradient from before it, or whose later pass found the gradients cleared
        (:class:`~gns_callback.grad_watch.StaleGradients`): the first is skipped (a gradient, or a pass, left over
        from before the meter, say); a second means the loop reads more than once per optimizer step, and measuring
        stops. Passes found cleared after the first step stop it at once: ``meter.step()`` was skipped at a step,
        which a loop may do only now and then (the checks cover the first steps only). With ``reduce`` the ranks
        stop together and no rank skips alone. True if this step is not measured."""
        self._stale_steps += 1
        final = self._stale_steps > 1 or (reason != STALE and self.steps_offered > 1)
        if self.reduce is not None:
            self._problem = self._problem or (reason if final else None)
            return False
        if final:
            self.stop(reason)
        else:
            self._skip_step()
        return True

    def _gradients_changed(self, loss_scale: Union[torch.Tensor, float, None]) -> Verdict:
        """How the gradients changed after backward (:meth:`backward_done`; :class:`~gns_callback.grad_watch.
        Verdict`): their versions at every step, the watched norms at every step on the CPU and on an accelerator at
        the steps the ranks agree on (a host sync). With ``reduce`` the ranks stop together."""
        norms = self._watch.on_host() or self.steps_seen < AGREE_FIRST or self.steps_seen % AGREE_EVERY == 0
        verdict = self._watch.verdict(loss_scale, norms=norms)
        if verdict.problem is not None and self.reduce is not None:
            self._problem = self._problem or verdict.problem
        return verdict

    def _skip_step(self) -> None:
        """Leave this step out, counted as skipped: a gradient left from before it (:meth:`_stale_step`), or
        gradients the loop changed after backward with their ``|G_B|²`` not kept at the end of backward (the first
        step that changes them; :class:`~gns_callback.grad_watch.GradientWatch` keeps it from the next one)."""
        self.steps_seen += 1
        self.discard_pending()

    def _say_unmeasurable(self, window: AccumulationWindow) -> None:
        """Warn that steps are skipped because their small and big batches are the same size (one micro-batch of one
        example on one device, say), at the first step this meter sees if it is one: else every step could be
        skipped with nothing said but ``skipped_steps``."""
        warnings.warn(
            f"gns_callback skips optimizer steps it can't measure: this one's small and big batches are the same "
            f"size ({window.micro_size_sum:g} example(s) in {window.micro_count} micro-batch(es)). Per-example norms "
            "need 2+ examples in a micro-batch, micro-batch norms 2+ micro-batches per step. Such steps are counted "
            "in skipped_steps; with micro-batches of one example, accumulate gradients over 2+ of them (Lightning: "
            "accumulate_grad_batches=2) or train on 2+ devices.", stacklevel=3)

    def _step_across_ranks(self, window: AccumulationWindow, loss_scale: Union[torch.Tensor, float, None],
                           loss: Union[torch.Tensor, float, None]) -> None:
        """Every rank joins the step's one all-reduce, even with nothing measured or a problem found."""
        self.steps_seen += 1
        self._steps_across_ranks += 1
        self._measure(window, loss_scale, loss)
        if self._steps_across_ranks <= AGREE_FIRST or self._steps_across_ranks % AGREE_EVERY == 0:
            self.settle()

    def settle(self) -> None:
        """Agree across ranks on the problems found since the last agreement, and stop or switch method together.

        A host sync; with ``reduce``, call it on every rank at the same step (:meth:`step` does so on its own
        schedule; the Lightning callback also calls it at fit end). Without ``reduce`` it does nothing."""
        flag, self._any_rank_failed = self._any_rank_failed, None
        if flag is not None and bool(flag):
            self._give_up(self._problem or "another data-parallel rank found a step it could not measure (its "
                                            "warning says why)")

    def _collect(self, sizes: Optional[list[Optional[int]]], loss_divisor: Optional[float]) -> AccumulationWindow:
        window = AccumulationWindow()
        try:
            passes = self.collector.pop_into(window, batch_sizes=sizes, loss_divisor=loss_divisor,
                                             loss_reduction=self.loss_reduction)
        except Exception as error:  # noqa: BLE001 - the hooks found the step unmeasurable, or a bug: never kill the run
            self._unreadable = True
            self._problem = self._problem or (str(error) if isinstance(error, RuntimeError) else
                                              f"an error reading the step's norms ({type(error).__name__}: {error}): "
                                              "a bug in gns_callback, please report it with the model")
            self.discard_pending()
            return AccumulationWindow()  # this rank adds nothing to the step
        window.loss_divisor = float(loss_divisor or max(passes, 1))
        if window.micro_count:
            self.examples_per_pass = window.micro_size_sum / window.micro_count
        doubt = getattr(self.collector, "size_doubt", None)
        if doubt is not None and not self._size_doubt_said:
            self._size_doubt_said = True
            warnings.warn(f"gns_callback: {doubt}", stacklevel=4)
        return window

    def _measure(self, window: AccumulationWindow, loss_scale: Union[torch.Tensor, float, None],
                 loss: Union[torch.Tensor, float, None] = None,
                 at_mark: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """The step's numbers, summed across ranks with ``reduce``, then used on the host: read at once on the
        CPU; from an accelerator copied without a sync and used a step later (:mod:`gns_callback.deferred`).
        ``at_mark``: ``|G_B|²`` as backward left it, to read instead of ``.grad`` (:meth:`_step_squares`)."""
        grads = [p.grad for p in self.collector.measured_parameters() if p.grad is not None]
        grad_sq, left_out = self._step_squares(grads, loss_scale, at_mark)
        subset = self._may_measure_a_subset(window)
        if self.reduce is None and _on_host(grads, loss_scale):
            values = [*window.packed_values(loss_scale), float(grad_sq), _host_loss(loss), 0.0, float(left_out)]
            return self._apply(values, subset, loss is not None)
        if self.reduce is None:
            return self._measure_later(window, grad_sq, left_out, loss_scale, loss, subset)
        device = grads[0].device if grads else None
        packed = window.packed(device, loss_scale)
        step_loss = _loss_tensor(loss, packed)
        if self.reduce is not None:
            packed, step_loss = self._reduce(packed, step_loss)  # the one collective per step, joined by every rank
        if not grads:
            return
        failed = torch.zeros(()) if self._any_rank_failed is None else self._any_rank_failed
        parts = [packed, grad_sq, step_loss, failed.to(device=packed.device),
                 left_out.to(device=packed.device)]
        self._reads.push(torch.cat([part.to(torch.float64).reshape(-1) for part in parts]),
                         _ReducedRow(subset, loss is not None))
        self._apply_read(keep=1)

    def _step_squares(self, grads: list[torch.Tensor], loss_scale: Union[torch.Tensor, float, None],
                      at_mark: Optional[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's ``|G_B|²`` over the measured and over the left-out parameters: read off ``.grad``, or where the
        loop changed the gradients after backward (clipping before ``meter.step()``), as backward left them
        (``at_mark``), less the loss scale: what the per-example norms were taken from."""
        if at_mark is None:
            return squared_norm_sum(grads), squared_norm_sum(self._left_out_grads())
        scale_sq = 1.0 if loss_scale is None else loss_scale * loss_scale
        return at_mark[0] / scale_sq, at_mark[1] / scale_sq

    def _measure_later(self, window: AccumulationWindow, grad_sq: torch.Tensor, left_out: torch.Tensor,
                       loss_scale: Union[torch.Tensor, float, None], loss: Union[torch.Tensor, float, None],
                       subset: bool) -> None:
        """One process on an accelerator: the window's device scalars, the step's |G_B|² over the measured and over
        the left-out parameters, and the loss and loss scale where they are device tensors, go to the host in one
        copy; the window's host sums wait with them."""
        row = _LocalRow(window, subset, loss, loss_scale)
        self._reads.push(row.to_send(grad_sq, left_out), row)
        self._apply_read(keep=1)

    def _apply_read(self, keep: int = 0) -> None:
        """Use the steps copied from the device, all but the newest ``keep``."""
        for values, row in self._reads.pop(keep):
            self._apply(row.values(values), row.subset, row.loss_given)

    def _apply(self, values: list[float], subset: bool, loss_given: bool) -> None:
        """One step on host floats (``PACKED_FIELDS``, then the step's |G_B|², its loss, whether any rank failed
        since the last agreement, and |G_B|² over the parameters left out): step estimates (blended when a subset
        was measured), then the recent estimate, the run average, the critical-batch sums
        (:mod:`gns_callback.scalar_ops`) and the left-out share (:mod:`gns_callback.left_out`)."""
        fields = len(PACKED_FIELDS)
        packed, (step_grad_sq, loss, failed, left_out_sq) = values[:fields], values[fields:]
        if self.failure is not None:
            return
        problem = self._read_problem(packed, step_grad_sq)
        if problem is not None:
            return self.stop(problem)
        with host_errors_ignored():
            trace, grad_sq, valid = step_estimates(packed, step_grad_sq, self.loss_reduction,
                                                   self.blend if subset else None)
            trace, grad_sq = without_replacement(trace, grad_sq, self.population)
            step = step_values(trace, grad_sq)  # shared by the accumulators; a non-finite step adds nothing
        valid = bool(valid) and not failed
        self._count_overflow(math.isfinite(step_grad_sq))
        self.ema.update_values(float(trace), float(grad_sq), valid)
        self.run.update_values(step, valid)
        self.critical.update_values(step, loss, valid)
        self.left_out.update(left_out_sq, step_grad_sq, packed[PACKED_FIELDS.index("micro_size_sum")], valid)
        self.losses_given = self.losses_given or loss_given

    def _count_overflow(self, finite: bool) -> None:
        """Count the step in :attr:`overflows`; warn once when the steps it left out start to bias the estimate
        (:mod:`gns_callback.overflows`), which is then withheld while they do."""
        self.overflows.update(finite)
        problem = self.overflows.problem()
        if problem is not None and self._may_say_overflows:
            self._may_say_overflows = False
            warnings.warn(f"gns_callback withholds the gradient noise scale: {problem}.", RuntimeWarning, stacklevel=4)

    def withheld(self) -> Optional[str]:
        """Why no estimate is given now: measuring stopped (:attr:`failure`), or too many steps overflowed since the
        first finite one (:mod:`gns_callback.overflows`); None otherwise."""
        return self.failure or self.overflows.problem()

    def _read_problem(self, packed: list[float], step_grad_sq: float) -> Optional[str]:
        """Why the step's |G_B|² and its small-batch norms can't be of the same gradients, or None: a zero gradient
        beside nonzero norms (cleared before the read), or a mean gradient above the mean of its parts (different
        scales, :func:`~gns_callback.accumulation.scale_mismatch`; a step the GradScaler skips reads inf: not this)."""
        if step_grad_sq == 0.0 and packed[0] > 0.0:  # no sum of nonzero gradients is exactly zero
            return GRADIENTS_CLEARED
        mismatch = scale_mismatch(packed, step_grad_sq, self.loss_reduction)
        if math.isfinite(mismatch) and mismatch > SCALE_MARGIN:
            return SCALES_DIFFER.format(ratio=mismatch)
        return None

    def _left_out_grads(self) -> list[torch.Tensor]:
        """The step gradient's part over the trainable parameters the collector leaves out, where the estimate is
        the whole model's (:meth:`attach`); else none."""
        return [p.grad for p in self._left_out_parameters() if p.grad is not None]

    def _left_out_parameters(self) -> list[nn.Parameter]:
        return self.collector.left_out_parameters() if self._widens_for_left_out else []

    def _may_measure_a_subset(self, window: AccumulationWindow) -> bool:
        """Whether this step's |G|² may need the blend: ``per_example`` with fewer examples measured than seen here,
        or on any rank (with ``reduce`` every rank blends, so that the blend's state stays identical)."""
        if self.method != "per_example":
            return False
        return self.reduce is not None or window.unit_count < window.micro_size_sum

    def _reduce(self, packed: torch.Tensor, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sum ``packed`` over ranks with this rank's loss and problem flag appended; remember (on the device) if
        any rank had a problem; return the summed ``packed`` and the ranks' mean loss."""
        flag = torch.tensor([float(self._problem is not None)], dtype=packed.dtype).to(packed.device)
        summed = self.reduce(torch.cat([packed, loss.view(1), flag]))
        failed = summed[-1] > 0
        self._any_rank_failed = failed if self._any_rank_failed is None else self._any_rank_failed | failed
        return summed[:-2], summed[-2] / summed[PACKED_FIELDS.index("ranks")]

    def _give_up(self, reason: str) -> None:
        """Switch to the fallback method (all ranks at once), or stop measuring: stop where the batch's size was
        misread (:data:`~gns_callback.per_example.tracker.MISREAD_BATCH_SIZE`), which the fallback would read at the
        same wrong size."""
        if self.fallback_method is None or MISREAD_BATCH_SIZE in reason:
            return self.stop(reason)
        self._switch_to(self.fallback_method, reason)

    def _switch_to(self, method: str, reason: str) -> None:
        """Measure with ``method`` from the next step on; the steps measured so far are forgotten (they measured
        another method's share of the parameters, with hooks that have just proved unreliable on this model)."""
        warnings.warn(
            f"gns_callback switched from method={self.method!r} to {method!r} for the rest of the run (the estimate "
            f"restarts from the next step), because the per-step check found: {reason}",
            stacklevel=4,
        )
        self._use_collector(method)
        self.switched_from, self.method, self.fallback_method = self.method, method, None
        self.reset()

    def stop(self, reason: str) -> None:
        """Stop measuring for the rest of the run: warn once; estimates read "not measured" from now on.

        With ``reduce``, call it on every rank at the same step (the meter's own stops are agreed across ranks)."""
        self._apply_read()  # the steps measured before the trouble stay in the state
        if self.failure is None:
            self.failure = reason
            warnings.warn(f"gns_callback stopped measuring the gradient noise scale: {reason}", stacklevel=3)
        self.discard_pending()

    # ------------------------------------------------------------------ results
    def read(self) -> tuple[GNSEstimate, GNSEstimate]:
        """``(estimate, run_estimate)`` with one device-to-host copy (the tracker's and the run's sums packed)."""
        self._apply_read()
        recent = self.ema.packed()
        values = torch.cat([recent, self.run.sums.to(recent.device)]).tolist()
        recent_row, run_sums = values[: recent.numel()], values[recent.numel():]
        measured = round(run_sums[0])  # the run average's weight counts the valid steps
        skipped = self.steps_seen - measured
        return (self._estimate(self.ema.summary_of(recent_row, self.confidence), measured - self.recent_from,
                               skipped, "ema"),
                self._estimate(summarize_ratio(run_sums, self.confidence), measured, skipped, "run"))

    @property
    def estimate(self) -> GNSEstimate:
        """The recent estimate (:class:`~gns_callback.tracking.LocalLinearRatio`: ``B_simple`` now, following a
        moving run) with its interval. ``steps`` counts the steps since it started (all measured steps, except
        after resuming a version-2 state)."""
        return self.read()[0]

    @property
    def run_estimate(self) -> GNSEstimate:
        """The run-average estimate (every measured step weighted equally) with its interval."""
        return self.read()[1]

    def _estimate(self, summary: RatioSummary, steps: int, skipped: int, averaging: str) -> GNSEstimate:
        estimate = GNSEstimate.from_summary(
            summary,
            confidence=self.confidence,
            steps=steps,
            skipped_steps=skipped,
            method=self.method,
            averaging=averaging,
        )
        withheld = self.withheld()
        if withheld is not None:
            return estimate.not_measured(withheld)
        if estimate.measured:
            estimate = dataclasses.replace(estimate, ci_high=self._upper_end(estimate.ci_high))
        return self.left_out.widened(estimate, self.population)

    def _upper_end(self, high: float) -> float:
        """An interval's upper end, made to hold a ``B_simple`` whose noise is drawn afresh at each draw of an
        example where :attr:`draws_vary` (:func:`~gns_callback.sampling.varying_draws_high`)."""
        return varying_draws_high(high, self.population) if self.draws_vary else high

    @property
    def critical_batch(self) -> CriticalBatchEstimate:
        """The critical batch of the run so far (:mod:`gns_callback.critical_batch`): what a fixed batch size
        should aim at, whatever batch this run measured at. One device-to-host copy."""
        self._apply_read()
        estimate = self.critical.summary(self.confidence)
        if not self.losses_given:
            estimate = dataclasses.replace(estimate, method="run average (no training loss was passed to step())")
        withheld = self.withheld()
        if withheld is not None:
            return dataclasses.replace(estimate, b_crit=math.nan, ci_low=math.nan, ci_high=math.nan,
                                       method=f"not measured ({withheld})")
        # The parameters left out, with the run's share: the critical batch's blocks are the run's steps, weighted
        # by the loss windows it draws, so this is the run average's bound applied to them (gns_callback/left_out.py).
        low, high = self.left_out.interval(estimate.ci_low, self._upper_end(estimate.ci_high), self.population)
        early_low = self.left_out.interval(estimate.early_noise_scale_low, math.inf, self.population)[0]
        return dataclasses.replace(estimate, ci_low=low, ci_high=high, early_noise_scale_low=early_low)

    @property
    def coverage(self) -> dict[str, Any]:
        """Measured vs trainable parameter counts, why the rest is left out, and the left-out parameters' share of
        the step gradient's squared norm against the measured ones' over the run (``r`` of
        :mod:`gns_callback.left_out`: the estimates' intervals make room for it). That share is None below
        ``MIN_COVERAGE``, where it is not read: the estimate is then the covered parameters' own."""
        share = self.left_out.share() if self._widens_for_left_out else None
        return {**self.collector.coverage().to_dict(), "left_out_gradient_share": share}


def _warn_not_restored(names: Sequence[str]) -> None:
    """The check's passes changed state it could not put back: from here on the run differs from one without the
    meter."""
    warnings.warn(
        f"gns_callback: the per-example check's passes of the training step changed module attribute(s) "
        f"{describe(names)} and could not put them back (too large to copy, or not copyable); the run now "
        "differs from one without gns_callback. Keep that state elsewhere, or pass method='micro_batch'.",
        RuntimeWarning, stacklevel=4)


def _host_loss(loss: Union[torch.Tensor, float, None]) -> float:
    """The step's loss as a host float (1 when not given, as in :func:`_loss_tensor`)."""
    return 1.0 if loss is None else float(loss)


def _loss_tensor(loss: Union[torch.Tensor, float, None], like: torch.Tensor) -> torch.Tensor:
    """The step's loss as a 0-d float64 tensor on ``like``'s device (1 when not given: a flat loss, so the
    critical batch is the run average)."""
    if loss is None:
        return torch.ones((), dtype=torch.float64, device=like.device)
    return torch.as_tensor(loss).detach().to(device=like.device, dtype=torch.float64).reshape(())


@dataclasses.dataclass
class _ReducedRow:
    """A step summed across ranks: its copied values are already the whole row for :meth:`_apply`."""

    subset: bool
    loss_given: bool

    def values(self, copied: list[float]) -> list[float]:
        return copied


@dataclasses.dataclass
class _LocalRow:
    """A step of one process on an accelerator, while its device scalars travel to the host in one copy: what
    travels (:meth:`to_send`) and how the row is read back (:meth:`values`), in one place. The window keeps the host
    sums and weights; the loss and loss scale travel only where they are tensors."""

    window: AccumulationWindow
    subset: bool
    loss: Union[torch.Tensor, float, None]
    scale: Union[torch.Tensor, float, None]

    @property
    def loss_given(self) -> bool:
        return self.loss is not None

    def to_send(self, grad_sq: torch.Tensor, left_out_sq: torch.Tensor) -> torch.Tensor:
        """The window's device scalars, ``|G_B|²`` over the measured and over the left-out parameters, then the loss
        and the scale where they are tensors, as one float32 vector on the gradients' device (a loss or scale on
        another device joins it there)."""
        tensors = [*self.window.device_squares(), grad_sq, left_out_sq]
        tensors += [value for value in (self.loss, self.scale) if isinstance(value, torch.Tensor)]
        device = tensors[0].device
        return torch.stack([v.detach().reshape(()).to(device, torch.float32) for v in tensors])

    def values(self, copied: list[float]) -> list[float]:
        """The row for :meth:`GradientNoiseScaleMeter._apply` from :meth:`to_send`'s values on the host."""
        squares = len(self.window.device_squares())
        rest = iter(copied[squares:])
        grad_sq, left_out_sq = next(rest), next(rest)
        loss = next(rest) if isinstance(self.loss, torch.Tensor) else _host_loss(self.loss)
        scale = next(rest) if isinstance(self.scale, torch.Tensor) else self.scale
        return [*self.window.packed_values(scale, copied[:squares]), grad_sq, loss, 0.0, left_out_sq]


def _on_host(grads: list[torch.Tensor], loss_scale: Union[torch.Tensor, float, None]) -> bool:
    """Whether the step's gradients (hence its small-batch norms) and the loss scale are on the CPU."""
    scale_on_cpu = not isinstance(loss_scale, torch.Tensor) or loss_scale.device.type == "cpu"
    return bool(grads) and scale_on_cpu and all(g.device.type == "cpu" for g in grads)


def _step_arguments_problem(micro_batch_size: BatchSizes, loss_scale: Union[torch.Tensor, float, None],
                            loss_divisor: Optional[float]) -> Optional[str]:
    """What is wrong with :meth:`GradientNoiseScaleMeter.step`'s arguments, naming the argument and a valid value;
    None if nothing (a tensor ``loss_scale`` is not read: that would cost a device sync). Before, a float size
    crashed the loop (``TypeError: 'float' object is not iterable``), a string was read as one size per character,
    and a zero or negative loss scale or divisor was taken as given."""
    sizes = micro_batch_size if isinstance(micro_batch_size, (list, tuple)) else [micro_batch_size]
    if not all(size is None or args.int_at_least(1)(size) for size in sizes):
        return (f"GradientNoiseScaleMeter.step(micro_batch_size={micro_batch_size!r}): must be the examples of one "
                "backward pass, an int ≥ 1 (e.g. micro_batch_size=8), a list of one per pass, or None")
    if not (loss_scale is None or isinstance(loss_scale, torch.Tensor)
            or args.number_in(0, math.inf, low_open=True, high_open=True)(loss_scale)):
        return (f"GradientNoiseScaleMeter.step(loss_scale={loss_scale!r}): must be the AMP GradScaler's scale, a "
                "number > 0 or a tensor (e.g. loss_scale=scaler.get_scale()), or None without a scaler")
    if not (loss_divisor is None or args.number_in(0, math.inf, low_open=True, high_open=True)(loss_divisor)):
        return (f"GradientNoiseScaleMeter.step(loss_divisor={loss_divisor!r}): must be what each backward pass's loss "
                "was divided by, a number > 0 (e.g. loss_divisor=4 for (loss / 4).backward()), or None for the "
                "number of passes")
    return None


def _as_sizes(micro_batch_size: BatchSizes) -> Optional[list[Optional[int]]]:
    """One entry per backward pass, or one for all; ``None`` entries: that size is unknown."""
    if micro_batch_size is None:
        return None
    if isinstance(micro_batch_size, int):
        return [micro_batch_size]
    return [None if b is None else int(b) for b in micro_batch_size]


def _trainable_ids(model: nn.Module) -> tuple[int, ...]:
    return tuple(id(p) for p in model.parameters() if p.requires_grad)


__all__ = ["ARGUMENTS", "GradientNoiseScaleMeter", "all_reduce_sum", "LOSS_REDUCTIONS", "MEASURING_METHODS"]
