"""``GradientNoiseScaleMeter``: the measurement engine, for any PyTorch training loop (no Lightning).

It owns everything between a gradient and a number: the collector's hooks (:mod:`gns_callback.collectors`),
each step's window of small-batch norms (:mod:`gns_callback.accumulation`), the step's unbiased ``tr(Σ)`` and
``|G|²`` (:mod:`gns_callback.estimators`), their smoothing and interval (:mod:`gns_callback.smoothing`), and
checkpoint state. A gradient's path: hook → collector (per pass) → :meth:`step` (window → step estimates →
accumulators) → :attr:`estimate`. The Lightning callback only tells it what Lightning knows.

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
from types import TracebackType
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch import nn

from gns_callback.accumulation import PACKED_FIELDS, AccumulationWindow, LossReduction, step_estimates
from gns_callback.collectors import COLLECTORS, Collector
from gns_callback.critical_batch import CriticalBatchAccumulator, CriticalBatchEstimate
from gns_callback.estimate import GNSEstimate
from gns_callback.smoothing import RatioAccumulator, step_vector, summarize_ratio

LOSS_REDUCTIONS = ("mean", "sum")
MEASURING_METHODS = tuple(COLLECTORS)
STATE_VERSION = 2

#: ``reduce(t) -> t`` summing a float64 tensor over data-parallel ranks (e.g. ``torch.distributed.all_reduce``).
SumAcrossRanks = Callable[[torch.Tensor], torch.Tensor]
BatchSizes = Union[int, Sequence[int], None]


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
        ema_decay: weight of the past in the recent estimate's moving averages, in ``[0, 1)``.
        confidence: level of the reported intervals, in ``(0, 1)``.
        loss_reduction: ``"mean"`` or ``"sum"``: what each backward pass's loss is over its batch.
        per_example_max_examples: ``per_example`` measures at most this many examples of each batch (None: all).
        reduce: sums a float64 tensor over data-parallel ranks (None: one process). With it, every rank must call
            :meth:`step` at every optimizer step: it runs one collective.

    Read :attr:`estimate` (recent, EMA) and :attr:`run_estimate` (every measured step weighted equally); each
    read copies the sums to the host once. If the hooks find the model unmeasurable mid-run (a module applied
    twice, the batch not in dim 0, ...), the meter stops measuring, warns once, and both estimates read "not
    measured" (NaN) with the reason in ``failure``; it never raises inside the user's backward pass.
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
    ) -> None:
        _validate(method, ema_decay, confidence, loss_reduction, per_example_max_examples)
        self.model = model
        self.method = method
        self.ema_decay = float(ema_decay)
        self.confidence = float(confidence)
        self.loss_reduction: LossReduction = loss_reduction
        self.reduce = reduce
        self.collector: Collector = COLLECTORS[method](model, max_examples=per_example_max_examples)
        self.reset()

    # ------------------------------------------------------------------ hooks on / off
    def attach(self) -> "GradientNoiseScaleMeter":
        """Put the hooks on (idempotent)."""
        self.collector.attach()
        return self

    def detach(self) -> None:
        """Take every hook off."""
        self.collector.detach()

    def __enter__(self) -> "GradientNoiseScaleMeter":
        return self.attach()

    def __exit__(
        self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException], tb: Optional[TracebackType]
    ) -> None:
        self.detach()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hooks inert inside (forward/backward passes that are not training steps), and what they left dropped."""
        was = self.collector.enabled
        self.collector.enabled = False
        try:
            yield
        finally:
            self.collector.enabled = was
            self.discard_pending()

    def discard_pending(self) -> None:
        """Drop what the hooks recorded since the last :meth:`step` (e.g. a step that will not be taken)."""
        self.collector.discard()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget every measured step."""
        self.ema = RatioAccumulator(self.ema_decay)
        self.run = RatioAccumulator(1.0)
        self.critical = CriticalBatchAccumulator()
        self.losses_given = False
        self.steps_seen = 0  # optimizer steps offered for measurement
        self.failure: Optional[str] = None

    def state_dict(self) -> dict[str, Any]:
        """Plain types only (checkpoints load with ``weights_only=True``)."""
        return {
            "version": STATE_VERSION,
            "method": self.method,
            "ema": self.ema.state_dict(),
            "run": self.run.state_dict(),
            "critical": self.critical.state_dict(),
            "losses_given": self.losses_given,
            "steps_seen": self.steps_seen,
            "failure": self.failure,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict(state["ema"])
        self.run.load_state_dict(state["run"])
        if state.get("critical"):
            self.critical.load_state_dict(state["critical"])
            self.losses_given = bool(state.get("losses_given"))
        self.steps_seen = int(state["steps_seen"])
        self.failure = state.get("failure")

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
            micro_batch_size: examples per backward pass (an int for all, or one per pass). Needed by
                ``micro_batch``; ``per_example`` reads sizes off its hooks and checks them against it if given.
            loss_scale: the AMP GradScaler's scale the backward passes ran with (the optimizer's ``.grad`` must
                be unscaled by now, as after ``scaler.unscale_(optimizer)``); None without a scaler.
            loss_divisor: what each backward pass's loss was divided by (None: the number of passes, as in
                ``(loss / accumulate).backward()``; Lightning: ``accumulate_grad_batches``).
            loss: the step's training loss (any constant factor is fine). With it, :attr:`critical_batch` reads the
                critical batch off the noise scale as a function of the loss; without it, that is the run average.
        """
        if self.failure is not None:
            return self.discard_pending()
        window = self._collect(_as_sizes(micro_batch_size), loss_divisor)
        if window is None or (window.empty and self.reduce is None):
            return
        self.steps_seen += 1
        if self.reduce is None and not window.measurable(self.loss_reduction):
            return  # e.g. one micro-batch on one device: nothing to compare (counted as skipped)
        self._measure(window, loss_scale, loss)

    def _collect(self, sizes: Optional[list[int]], loss_divisor: Optional[float]) -> Optional[AccumulationWindow]:
        window = AccumulationWindow()
        try:
            passes = self.collector.pop_into(window, batch_sizes=sizes, loss_divisor=loss_divisor,
                                             loss_reduction=self.loss_reduction)
        except RuntimeError as error:  # the hooks found the model unmeasurable: never kill the run
            self.stop(str(error))
            return None
        window.loss_divisor = float(loss_divisor or max(passes, 1))
        return window

    def _measure(self, window: AccumulationWindow, loss_scale: Union[torch.Tensor, float, None],
                 loss: Union[torch.Tensor, float, None]) -> None:
        grads = [p.grad for p in self.collector.measured_parameters() if p.grad is not None]
        device = grads[0].device if grads else None
        packed = window.packed(device, loss_scale)
        step_loss = _loss_tensor(loss, packed)
        if self.reduce is not None:  # the one collective per step, joined by every rank; the loss rides along
            summed = self.reduce(torch.cat([packed, step_loss.view(1)]))
            packed, step_loss = summed[:-1], summed[-1] / summed[PACKED_FIELDS.index("ranks")]
        if not grads:
            return
        step_grad_sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        trace, grad_sq, valid = step_estimates(packed, step_grad_sq, self.loss_reduction)
        step = step_vector(trace, grad_sq)  # shared by both accumulators; a non-finite step adds nothing
        self.ema.update_vector(step, valid)
        self.run.update_vector(step, valid)
        self.critical.update(trace, grad_sq, step_loss, valid)  # the ranks' mean loss: identical state everywhere
        self.losses_given = self.losses_given or loss is not None

    def stop(self, reason: str) -> None:
        """Stop measuring for the rest of the run: warn once; estimates read "not measured" from now on."""
        if self.failure is None:
            self.failure = reason
            warnings.warn(f"gns_callback stopped measuring the gradient noise scale: {reason}", stacklevel=3)
        self.discard_pending()

    # ------------------------------------------------------------------ results
    def read(self) -> tuple[GNSEstimate, GNSEstimate]:
        """``(estimate, run_estimate)`` with one device-to-host copy."""
        ema_sums, run_sums = torch.stack([self.ema.sums, self.run.sums.to(self.ema.sums.device)]).tolist()
        measured = round(run_sums[0])  # the run average's weight counts the valid steps
        return self._estimate(ema_sums, measured, "ema"), self._estimate(run_sums, measured, "run")

    @property
    def estimate(self) -> GNSEstimate:
        """The recent estimate (EMA of ``tr(Σ)`` and ``|G|²``, ratio read now) with its interval."""
        return self.read()[0]

    @property
    def run_estimate(self) -> GNSEstimate:
        """The run-average estimate (every measured step weighted equally) with its interval."""
        return self.read()[1]

    def _estimate(self, sums: list[float], measured: int, averaging: str) -> GNSEstimate:
        estimate = GNSEstimate.from_summary(
            summarize_ratio(sums, self.confidence),
            confidence=self.confidence,
            steps=measured,
            skipped_steps=self.steps_seen - measured,
            method=self.method,
            averaging=averaging,
        )
        return estimate if self.failure is None else estimate.not_measured(self.failure)

    @property
    def critical_batch(self) -> CriticalBatchEstimate:
        """The critical batch of the run so far (:mod:`gns_callback.critical_batch`): what a fixed batch size
        should aim at, whatever batch this run measured at. One device-to-host copy."""
        estimate = self.critical.summary(self.confidence)
        if not self.losses_given:
            estimate = dataclasses.replace(estimate, method="run average (no training loss was passed to step())")
        if self.failure is not None:
            estimate = dataclasses.replace(estimate, b_crit=math.nan, ci_low=math.nan, ci_high=math.nan,
                                           method=f"not measured ({self.failure})")
        return estimate

    @property
    def coverage(self) -> dict[str, Any]:
        """Measured vs trainable parameter counts and why the rest is left out."""
        return self.collector.coverage().to_dict()


def _loss_tensor(loss: Union[torch.Tensor, float, None], like: torch.Tensor) -> torch.Tensor:
    """The step's loss as a 0-d float64 tensor on ``like``'s device (1 when not given: a flat loss, so the
    critical batch is the run average)."""
    if loss is None:
        return torch.ones((), dtype=torch.float64, device=like.device)
    return torch.as_tensor(loss).detach().to(device=like.device, dtype=torch.float64).reshape(())


def _as_sizes(micro_batch_size: BatchSizes) -> Optional[list[int]]:
    if micro_batch_size is None:
        return None
    if isinstance(micro_batch_size, int):
        return [micro_batch_size]
    return [int(b) for b in micro_batch_size]


def _validate(method: str, ema_decay: float, confidence: float, loss_reduction: str, max_examples: Any) -> None:
    if method not in MEASURING_METHODS:
        raise ValueError(f"method={method!r}: use one of {', '.join(map(repr, MEASURING_METHODS))}.")
    if isinstance(ema_decay, bool) or not isinstance(ema_decay, (int, float)) or not 0.0 <= ema_decay < 1.0:
        raise ValueError(f"ema_decay={ema_decay!r}: a number in [0, 1), e.g. 0.99 (about the last 200 steps).")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence!r}: a number in (0, 1), e.g. 0.95.")
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"loss_reduction={loss_reduction!r}: 'mean' (the loss is averaged over the batch) or 'sum'."
        )
    if max_examples is not None and (isinstance(max_examples, bool) or not isinstance(max_examples, int)
                                     or max_examples < 2):
        raise ValueError(
            f"per_example_max_examples={max_examples!r}: an int ≥ 2, or None to measure every example of each batch."
        )


__all__ = ["GradientNoiseScaleMeter", "all_reduce_sum", "LOSS_REDUCTIONS", "MEASURING_METHODS"]
