"""One trial at micro-batch size ``b``: tile the real batch to ``b`` samples, run forward, backward and an
optimizer step (Adam allocates its state on the first step, so it is part of the measurement), measure the
bytes (CUDA allocator peak, or :mod:`gns_callback.probe.accounting`), optionally time repeated steps
(:mod:`gns_callback.probe.timing`), then restore every piece of state (:mod:`gns_callback.probe.state`).
:meth:`TrialRunner.time_sizes` times several confirmed sizes round-robin in one restored session.

An OOM (:func:`gns_callback.probe.oom.is_oom`) or exceeding ``headroom × budget`` marks the trial failed;
anything else is re-raised once the state is back.
"""

from __future__ import annotations

import gc
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, Protocol, Sequence

import torch
from torch import Tensor, nn

from gns_callback.probe.accounting import (
    OverBudget,
    SavedTensorsMeter,
    cuda_peak_bytes,
    cuda_peak_start,
    static_bytes,
    storage_of,
)
from gns_callback.probe.batches import batch_size_of, resize_batch
from gns_callback.probe.config import ProbeConfig
from gns_callback.probe.memory_model import FIT
from gns_callback.probe.oom import is_oom, short_message
from gns_callback.probe.result import Trial
from gns_callback.probe.state import ProbeState
from gns_callback.probe.timing import Timing, precise_enough, summarize

#: Full steps a trial that may decide the answer runs on CUDA (the fit's small sizes run one).
DECIDING_STEPS = 2

#: A step function: ``step(batch) -> loss`` (the probe runs backward and the optimizer step), or ``None`` when
#: it did both itself (manual optimization).
StepFn = Callable[[Any], Optional[Tensor]]


class _Samples:
    """Per-repeat forward+backward and optimizer seconds of one size."""

    def __init__(self) -> None:
        self.step: list[float] = []
        self.optimizer: list[float] = []

    def add(self, step: float, optimizer: float) -> None:
        self.step.append(step)
        self.optimizer.append(optimizer)

    def timing(self) -> Timing:
        return summarize(self.step, self.optimizer)


class SplitHandle(Protocol):
    """Sets a model's ``batch_split_factor`` for the duration of a trial (``None``: unchanged)."""

    def applied(self, value: Optional[int]) -> AbstractContextManager[None]: ...


class TrialRunner:
    """Runs trials on a fixed model, optimizers and example batch; restores ``state`` after each one."""

    def __init__(
        self,
        module: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        batch: Any,
        step: StepFn,
        *,
        device: torch.device,
        measure: str,
        limit_bytes: float,
        config: ProbeConfig,
        state: ProbeState,
        split_handle: Optional[SplitHandle] = None,
        bar: Any = None,
        batch_size: Optional[int] = None,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.batch = batch
        self.batch_size = batch_size_of(batch) if batch_size is None else int(batch_size)
        self.step = step
        self.device = device
        self.measure = measure
        self.limit_bytes = limit_bytes
        self.config = config
        self.state = state
        self.split_handle = split_handle
        self.bar = bar
        self.params = list({id(p): p for p in module.parameters()}.values())
        self._param_keys = {found[0] for p in self.params if (found := storage_of(p)) is not None}
        self.trials: list[Trial] = []

    # one step ---------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _forward_backward(self, batch: Any) -> bool:
        """Forward and backward of one micro-batch; False if the step function stepped itself (manual).

        Submodule modes are kept as they are (frozen BatchNorm stays in eval, as Lightning 2.x keeps it), but a
        module in eval mode as a whole is put in train mode: trials are training steps (restored afterwards)."""
        if not self.module.training:
            self.module.train()
        with torch.enable_grad():
            loss = self.step(batch)
            if loss is None:
                return False
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError(f"the probe's step function must return a scalar loss tensor or None, got {type(loss)}")
            loss.backward()
        return True

    def _optimizer_step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def _full_step(self, batch: Any) -> None:
        self._zero_grad()
        if self._forward_backward(batch):
            self._optimizer_step()

    def _measured_step(self, batch: Any, steps: int = 1) -> int:
        """``steps`` full steps on CUDA (their peak), else one (params + grads + optimizer state + saved
        activations: the same at every step)."""
        self._zero_grad()
        if self.measure == "cuda":
            cuda_peak_start(self.device)
            for _ in range(steps):
                self._full_step(batch)
            return cuda_peak_bytes(self.device)
        before = static_bytes(self.params, self.optimizers)
        with SavedTensorsMeter(exclude=self._param_keys, abort_above=self.limit_bytes - before) as meter:
            stepped = self._forward_backward(batch)
        if stepped:
            self._optimizer_step()
        return static_bytes(self.params, self.optimizers) + meter.saved_bytes

    # timing ---------------------------------------------------------------------------------
    def _timed_repeat(self, batch: Any, samples: _Samples) -> None:
        """One timed step: forward+backward, then the optimizer step (0 s when the step stepped itself); on
        CUDA its peak must fit too."""
        self._zero_grad()
        if self.measure == "cuda":
            cuda_peak_start(self.device)
        start = time.perf_counter()
        stepped = self._forward_backward(batch)
        self._sync()
        middle = time.perf_counter()
        if stepped:
            self._optimizer_step()
            self._sync()
        samples.add(middle - start, time.perf_counter() - middle if stepped else 0.0)
        if self.measure == "cuda" and cuda_peak_bytes(self.device) > self.limit_bytes:
            raise OverBudget("a timed step went over the budget")

    def _enough(self, samples: _Samples, elapsed: float, budget_s: float) -> bool:
        """At least ``timed_steps``; then stop at ``max_timed_steps``, at the end of the budget, or once precise
        after half of it (a shorter window can look precise between two bursts of load; see timing.py)."""
        config = self.config
        n = len(samples.step)
        if n < config.timed_steps:
            return False
        if n >= config.max_timed_steps or elapsed >= budget_s:
            return True
        return elapsed >= budget_s / 2 and precise_enough(samples.timing(), config.timing_precision)

    def _timing_rounds(self, batches: dict[int, Any], budget_s: float) -> dict[int, Optional[Timing]]:
        """Rounds of one timed step per size (``batches``: ``{size: batch}``) until every size has enough
        (:meth:`_enough`). All sizes stay in every round, so all are timed over the same window: a size that
        stopped early would be compared with others timed later, under another load. A size that runs out of
        memory drops out with ``None`` (alone, it raises)."""
        for batch in batches.values():
            for _ in range(self.config.warmup_steps - 1):
                self._full_step(batch)
        samples = {size: _Samples() for size in batches}
        failed: set[int] = set()
        start = time.perf_counter()

        def running() -> list[int]:
            elapsed = time.perf_counter() - start
            sizes = [s for s in batches if s not in failed]
            return sizes if any(not self._enough(samples[s], elapsed, budget_s) for s in sizes) else []

        while sizes := running():
            for size in sizes:
                try:
                    self._timed_repeat(batches[size], samples[size])
                except Exception as exc:
                    if len(batches) == 1 or not (isinstance(exc, OverBudget) or is_oom(exc)):
                        raise
                    failed.add(size)
        return {size: None if size in failed else samples[size].timing() for size in batches}

    def time_sizes(self, sizes: Sequence[int], budget_s: float) -> dict[int, Optional[Timing]]:
        """Repeated timing of ``sizes`` that already ran (confirmed), interleaved so that a burst of load on a
        shared machine hits every size alike, in one session restored afterwards. ``None``: that size ran out
        of memory while timed."""
        try:
            batches = {size: resize_batch(self.batch, size, self.batch_size) for size in sizes}
            return self._timing_rounds(batches, budget_s)
        finally:
            self.state.restore()
            free_memory(self.device, after_failure=True)

    # one trial --------------------------------------------------------------------------------
    def _announce(self, size: int, phase: str, split: Optional[int]) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"{phase} b={size}" + (f" split={split}" if split else ""), refresh=False)
            self.bar.update(1)

    def _fits(self, trial: Trial, measured_bytes: int) -> None:
        trial.measured_bytes = measured_bytes
        trial.ok = measured_bytes <= self.limit_bytes
        trial.error = None if trial.ok else "over budget"

    def _attempt(self, trial: Trial, batch: Any, timed: bool) -> None:
        """The measured step, then (if it fits and ``timed``) repeated timing for a quarter of the budget.

        A size that may be the answer runs two steps on CUDA, as a run takes many and the truth it is compared
        with takes two: what the first step's frees leave fragmented can fail the next. (GPT-2 small on an H100:
        one step at 133 ran out of memory on one machine and ran on another, where the exhaustive search's two
        steps a size failed from 131 up; benchmarks/RESULTS.md, "GPU, fourth lease".)"""
        steps = 1 if trial.phase == FIT else DECIDING_STEPS
        self._fits(trial, self._measured_step(batch, steps))
        if trial.ok and timed:
            trial.timing = self._timing_rounds({trial.size: batch}, self.config.timing_budget_s / 4)[trial.size]

    def run(self, size: int, phase: str, *, timed: bool = False, split: Optional[int] = None) -> Trial:
        """One trial at ``size`` (with ``batch_split_factor = split`` if given); state restored afterwards.

        OOM and over-budget make a failed trial; other errors propagate (after the restore).
        """
        self._announce(size, phase, split)
        trial = Trial(size=size, ok=False, phase=phase, split=split)
        context = self.split_handle.applied(split) if self.split_handle is not None else nullcontext()
        try:
            with context:
                self._attempt(trial, resize_batch(self.batch, size, self.batch_size), timed)
        except OverBudget:
            trial.ok, trial.measured_bytes, trial.error = False, None, "over budget"
        except Exception as exc:
            if not is_oom(exc):
                raise
            trial.ok, trial.measured_bytes, trial.error = False, None, short_message(exc)
            # leaving the except block drops the traceback, and with it the frames holding the step's tensors
        finally:
            self.state.restore()
            free_memory(self.device, after_failure=not trial.ok)
        self.trials.append(trial)
        return trial


def free_memory(device: torch.device, after_failure: bool) -> None:
    """Give memory back between trials. Tensors of a finished step go by reference counting; a failed step can
    leave reference cycles (exception ↔ traceback ↔ frames holding activations), which a collection frees.
    A full collection costs ~0.3 s in a process that imported Lightning, so it runs only where it matters:
    after a failure on CUDA (the next trial's peak must not include them). On CPU the young generations suffice
    (the cycles were created during the trial)."""
    if after_failure:
        gc.collect(2 if device.type == "cuda" else 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()
