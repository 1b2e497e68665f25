"""The trial loop and the public entry points :func:`probe_trainer` and :func:`probe_micro_batch`.

One trial at micro-batch size ``b``: tile the real batch to ``b`` samples, run forward, backward and an
optimizer step (Adam allocates its state on the first step, so it is part of the measurement), measure the
bytes (CUDA allocator peak, or :mod:`gns_callback.probe.accounting`), optionally time a few more steps, then
restore every piece of state (:mod:`gns_callback.probe.state`). An OOM (:func:`gns_callback.probe.oom.is_oom`)
or exceeding ``headroom × budget`` marks the trial failed; anything else is re-raised once the state is back.

Under DDP every rank runs its own trials with no collective inside them (the model is called directly, not
through the DDP wrapper, inside ``no_sync``; SyncBatchNorm runs locally), then the ranks agree with an
element-wise all-reduce(MIN) of a small vector: the largest size that fits everywhere, and whether any rank
failed for another reason, in which case every rank raises. Composer's auto-microbatching showed why: a rank
that retries after an OOM while the others wait in a collective deadlocks them.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from gns_callback.probe.accounting import (
    OverBudget,
    SavedTensorsMeter,
    cuda_peak_bytes,
    cuda_peak_start,
    device_budget_bytes,
    static_bytes,
    storage_of,
)
from gns_callback.probe.memory_model import (
    PlannedTrial,
    bracket,
    fit_linear,
    next_trial,
    throughput_ladder,
)
from gns_callback.probe.oom import ProbeFailedOnOtherRank, is_oom, short_message
from gns_callback.probe.result import ProbeResult, Trial
from gns_callback.probe.split import SplitFactor, per_device_batch, run_split_search
from gns_callback.probe.state import ProbeState, local_batch_norm, preserved_state, silenced_logging

if TYPE_CHECKING:
    import pytorch_lightning as pl

#: A step function: ``step(batch) -> loss`` (the probe runs backward and the optimizer step), or ``None`` when
#: it did both itself (manual optimization).
StepFn = Callable[[Any], Optional[Tensor]]
#: ``agree(values) -> values``: element-wise minimum over ranks (identity on one process).
Agree = Callable[[list[float]], list[float]]

DEFAULT_FIT_SIZES = (2, 8, 32)
DEFAULT_MAX_BATCH_SIZE = 65536
MEASURES = ("auto", "cuda", "accounting")


MAX_TIMED_STEPS = 50


@dataclass(frozen=True)
class ProbeConfig:
    """Settings shared by both entry points (see :func:`probe_micro_batch` for their meaning)."""

    memory_budget_bytes: Optional[int] = None
    headroom: float = 0.85
    fit_sizes: tuple[int, ...] = DEFAULT_FIT_SIZES
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    rel_tol: float = 0.05
    measure: str = "auto"
    throughput: bool = True
    throughput_sizes: Optional[tuple[int, ...]] = None
    warmup_steps: int = 1
    timed_steps: int = 3
    #: Keep timing (up to MAX_TIMED_STEPS) until this much time is measured: a few 1 ms steps on a busy machine
    #: say nothing about throughput.
    min_timed_seconds: float = 0.25
    max_trials: int = 40
    progress_bar: bool = True
    verbose: bool = False

    def __post_init__(self) -> None:
        if self.memory_budget_bytes is not None and (
            isinstance(self.memory_budget_bytes, bool) or not self.memory_budget_bytes > 0
        ):
            raise ValueError(f"memory_budget_bytes={self.memory_budget_bytes!r}: a positive number of bytes, or None.")
        if not 0.0 < self.headroom <= 1.0:
            raise ValueError(f"headroom={self.headroom!r}: the usable fraction of the budget, in (0, 1].")
        if not self.fit_sizes or any(int(s) < 1 for s in self.fit_sizes):
            raise ValueError(f"fit_sizes={self.fit_sizes!r}: one or more positive sizes, e.g. (2, 8, 32).")
        if int(self.max_batch_size) < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size!r}: a positive int.")
        if not 0.0 <= self.rel_tol < 1.0:
            raise ValueError(f"rel_tol={self.rel_tol!r}: in [0, 1).")
        if self.measure not in MEASURES:
            raise ValueError(f"measure={self.measure!r}: one of {', '.join(MEASURES)}.")
        if self.warmup_steps < 1 or self.timed_steps < 1:
            raise ValueError("warmup_steps and timed_steps: at least 1 each.")
        if self.throughput_sizes is not None and any(int(s) < 1 for s in self.throughput_sizes):
            raise ValueError(f"throughput_sizes={self.throughput_sizes!r}: positive sizes, or None.")


# ------------------------------------------------------------------------------------------------ batches
def batch_size_of(batch: Any) -> int:
    """Size of dim 0 of the first tensor (with at least one dimension) in ``batch``."""
    sizes: list[int] = []
    apply_to_collection(batch, Tensor, lambda t: sizes.append(t.shape[0]) if t.ndim > 0 else None)
    if not sizes:
        raise ValueError("the probe needs a batch holding at least one tensor with a batch dimension.")
    return sizes[0]


def resize_batch(batch: Any, size: int, batch_size: Optional[int] = None) -> Any:
    """``batch`` with every tensor whose dim 0 is the batch size tiled (or cut) to ``size`` rows.

    Memory depends on shapes, not values, so repeating real samples is enough. The result is a fresh contiguous
    tensor of exactly ``size`` rows (``index_select``), so saved-tensor storages grow exactly linearly.
    """
    n = batch_size_of(batch) if batch_size is None else batch_size

    def resize(tensor: Tensor) -> Tensor:
        if tensor.ndim == 0 or tensor.shape[0] != n:
            return tensor
        index = torch.arange(size, device=tensor.device) % n
        return tensor.index_select(0, index)

    return apply_to_collection(batch, Tensor, resize)


def _move(batch: Any, device: torch.device) -> Any:
    return apply_to_collection(batch, Tensor, lambda t: t.to(device))


# ------------------------------------------------------------------------------------------------ trials
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
        split_factor: Optional[SplitFactor] = None,
        bar: Any = None,
    ) -> None:
        self.module = module
        self.optimizers = list(optimizers)
        self.batch = batch
        self.batch_size = batch_size_of(batch)
        self.step = step
        self.device = device
        self.measure = measure
        self.limit_bytes = limit_bytes
        self.config = config
        self.state = state
        self.split_factor = split_factor
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

    def _measured_step(self, batch: Any) -> int:
        """One full step; its bytes (CUDA peak, or params + grads + optimizer state + saved activations)."""
        self._zero_grad()
        if self.measure == "cuda":
            cuda_peak_start(self.device)
            self._full_step(batch)
            return cuda_peak_bytes(self.device)
        before = static_bytes(self.params, self.optimizers)
        with SavedTensorsMeter(exclude=self._param_keys, abort_above=self.limit_bytes - before) as meter:
            stepped = self._forward_backward(batch)
        if stepped:
            self._optimizer_step()
        return static_bytes(self.params, self.optimizers) + meter.saved_bytes

    def _timed_steps(self, batch: Any) -> tuple[float, float]:
        """``(forward+backward seconds per micro-batch, optimizer step seconds)``: medians over ``timed_steps``
        micro-batches (gradients accumulating) and as many optimizer steps, after ``warmup_steps`` untimed
        steps (the measured step was the first). Medians: robust to a stray slow step on a shared machine."""
        for _ in range(self.config.warmup_steps - 1):
            self._full_step(batch)
        self._zero_grad()
        self._sync()
        seconds, stepped = [], True
        while self._keep_timing(seconds):
            start = time.perf_counter()
            stepped = self._forward_backward(batch)
            self._sync()
            seconds.append(time.perf_counter() - start)
        optimizer_seconds: list[float] = []
        while stepped and self._keep_timing(optimizer_seconds):  # repeated steps on the same gradients
            start = time.perf_counter()
            self._optimizer_step()
            self._sync()
            optimizer_seconds.append(time.perf_counter() - start)
        return statistics.median(seconds), statistics.median(optimizer_seconds) if optimizer_seconds else 0.0

    def _keep_timing(self, seconds: list[float]) -> bool:
        """At least ``timed_steps`` steps, and more until ``min_timed_seconds`` are measured (capped)."""
        if len(seconds) < self.config.timed_steps:
            return True
        return len(seconds) < MAX_TIMED_STEPS and sum(seconds) < self.config.min_timed_seconds

    # one trial --------------------------------------------------------------------------------
    def run(self, size: int, phase: str, *, timed: bool = False, split: Optional[int] = None) -> Trial:
        """One trial at ``size`` (with ``batch_split_factor = split`` if given); state restored afterwards.

        OOM and over-budget make a failed trial; other errors propagate (after the restore).
        """
        if self.bar is not None:
            self.bar.set_postfix_str(f"{phase} b={size}" + (f" split={split}" if split else ""), refresh=False)
            self.bar.update(1)
        trial = Trial(size=size, ok=False, phase=phase, split=split)
        context = self.split_factor.applied(split) if self.split_factor is not None else nullcontext()
        try:
            with context:
                batch = resize_batch(self.batch, size, self.batch_size)
                trial.measured_bytes = self._measured_step(batch)
                if self.measure == "cuda":
                    cuda_peak_start(self.device)
                trial.ok = trial.measured_bytes <= self.limit_bytes
                if not trial.ok:
                    trial.error = "over budget"
                elif timed:
                    trial.step_seconds, trial.optimizer_seconds = self._timed_steps(batch)
                    total = trial.step_seconds + trial.optimizer_seconds
                    trial.samples_per_s = size / total if total > 0 else None
                    if self.measure == "cuda":  # the timed steps must fit too
                        trial.ok = cuda_peak_bytes(self.device) <= self.limit_bytes
                        trial.error = None if trial.ok else "over budget"
        except OverBudget:
            trial.ok, trial.measured_bytes, trial.error = False, None, "over budget"
        except Exception as exc:
            if not is_oom(exc):
                raise
            trial.ok, trial.measured_bytes, trial.error = False, None, short_message(exc)
            # leaving the except block drops the traceback, and with it the frames holding the step's tensors
        finally:
            batch = None
            self.state.restore()
            _free_memory(self.device, after_failure=not trial.ok)
        self.trials.append(trial)
        return trial


def _free_memory(device: torch.device, after_failure: bool) -> None:
    """Give memory back between trials. Tensors of a finished step go by reference counting; a failed step can
    leave reference cycles (exception ↔ traceback ↔ frames holding activations), which a collection frees.
    A full collection costs ~0.3 s in a process that imported Lightning, so it runs only where it matters:
    after a failure on CUDA (the next trial's peak must not include them). On CPU the young generations suffice
    (the cycles were created during the trial)."""
    if after_failure:
        gc.collect(2 if device.type == "cuda" else 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ search
def _encode(value: Optional[float]) -> float:
    return 0.0 if value is None or not math.isfinite(value) else float(value)


def _raise_agreed(flag: float, error: Optional[BaseException]) -> None:
    if flag < 0:
        if error is not None:
            raise error
        raise ProbeFailedOnOtherRank("the memory probe failed on another rank (see that rank's error)")


def _search(
    runner: TrialRunner,
    config: ProbeConfig,
    *,
    agree: Agree,
    world_size: int,
    budget: int,
    device: torch.device,
    measure: str,
    split_request: Optional[tuple[int, int, Optional[int]]] = None,
) -> ProbeResult:
    cap = int(config.max_batch_size)
    limit = config.headroom * budget
    planned: list[PlannedTrial] = []
    error: Optional[BaseException] = None
    # Alone, an error is raised at once; with other ranks it waits for the next agreement, so none of them
    # is left waiting in a collective this rank never reaches.
    alone = agree is _identity

    # 1. local memory search: fit, predict, verify, back off / bisect (no collectives in here)
    try:
        while len(planned) < config.max_trials:
            proposal = next_trial(planned, fit_sizes=config.fit_sizes, limit_bytes=limit, cap=cap, rel_tol=config.rel_tol)
            if proposal is None:
                break
            size, phase = proposal
            trial = runner.run(size, phase)
            planned.append(PlannedTrial(size, phase, trial.ok, trial.measured_bytes))
    except Exception as exc:
        if alone:
            raise
        error = exc
    local_max = bracket(planned, cap)[0]
    measured = [(t.size, t.measured_bytes) for t in planned if t.ok and t.measured_bytes is not None]
    model = fit_linear([s for s, _ in measured], [b for _, b in measured]) if measured else None

    # agreement 1: min size, min budget, max fixed and per-sample bytes (as min of negatives), any error
    agreed = agree([
        float(local_max),
        float(budget),
        -_encode(model.fixed_bytes if model else None),
        -_encode(model.bytes_per_sample if model else None),
        -1.0 if error is not None else 0.0,
    ])
    _raise_agreed(agreed[4], error)
    agreed_max, agreed_budget = int(agreed[0]), int(agreed[1])
    fixed, per_sample = -agreed[2], -agreed[3]

    # 2. confirm the agreed size on every rank and time the candidate sizes; agreement 2
    if not config.throughput:
        sizes = [agreed_max] if agreed_max > 0 else []
    elif config.throughput_sizes is not None:
        sizes = sorted(({int(s) for s in config.throughput_sizes if s <= agreed_max} | {agreed_max}) - {0})
    else:
        sizes = throughput_ladder(agreed_max)
    values: list[float] = []
    for size in sizes:
        already = any(t.size == size and t.ok for t in runner.trials)
        if error is not None:
            values += [0.0, 0.0, 0.0]
            continue
        if not config.throughput and already:
            values += [1.0, 0.0, 0.0]
            continue
        try:
            trial = runner.run(size, "throughput" if config.throughput else "confirm", timed=config.throughput)
        except Exception as exc:
            if alone:
                raise
            error = exc
            values += [0.0, 0.0, 0.0]
            continue
        values += [1.0 if trial.ok else 0.0, -_encode(trial.step_seconds), -_encode(trial.optimizer_seconds)]
    agreed = agree(values + [-1.0 if error is not None else 0.0])
    _raise_agreed(agreed[-1], error)
    fits = [size for i, size in enumerate(sizes) if agreed[3 * i] > 0.5]
    final_max = max(fits, default=0)
    throughput: dict[int, float] = {}
    if config.throughput:
        for i, size in enumerate(sizes):
            seconds = -agreed[3 * i + 1] - agreed[3 * i + 2]
            if agreed[3 * i] > 0.5 and seconds > 0:
                throughput[size] = size / seconds

    result = ProbeResult(
        max_micro_batch=final_max,
        fixed_bytes=fixed if (fixed or per_sample) else None,
        bytes_per_sample=per_sample if (fixed or per_sample) else None,
        budget_bytes=agreed_budget,
        headroom=config.headroom,
        device=str(device),
        measure=measure,
        trials=runner.trials,
        throughput=throughput,
        capped=final_max >= cap,
        world_size=world_size,
    )

    # 3. split-factor / accumulation search for a fixed global batch
    if split_request is not None:
        global_batch, devices, current_split = split_request
        result.split = run_split_search(
            lambda micro, split: runner.run(micro, "split", timed=True, split=split),
            agree,
            global_batch=global_batch,
            devices=devices,
            max_micro_batch=final_max,
            current_split=current_split,
        )
    return result


# ------------------------------------------------------------------------------------------------ glue
def _loss_from(output: Any, *, reduce: bool = False) -> Tensor:
    if isinstance(output, Tensor):
        return output if output.numel() == 1 or not reduce else output.float().mean()
    if isinstance(output, dict) and "loss" in output:
        return output["loss"]
    if getattr(output, "loss", None) is not None:
        return output.loss
    if isinstance(output, (tuple, list)) and output and reduce:
        return _loss_from(output[0], reduce=True)
    raise TypeError(
        f"the probe needs a loss from the step, got {type(output).__name__}; return a scalar tensor or a dict with "
        "'loss' from training_step (a step returning None is skipped by Lightning and cannot be measured)."
    )


def lightning_step(pl_module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None) -> StepFn:
    """``training_step(batch, 0)`` (``batch_idx`` only if its signature has one; inside the precision plugin's
    autocast context when a Trainer is given);
    with manual optimization the module steps itself and ``None`` is returned."""
    from pytorch_lightning.utilities.signature_utils import is_param_in_hook_signature

    context = trainer.precision_plugin.train_step_context if trainer is not None else nullcontext
    # as Lightning's loop does: pass batch_idx only where the signature takes it
    extra = (0,) if is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2) else ()

    def step(batch: Any) -> Optional[Tensor]:
        with context():
            output = pl_module.training_step(batch, *extra)
        if not getattr(pl_module, "automatic_optimization", True):
            return None
        return _loss_from(output)

    return step


def default_step(model: nn.Module) -> StepFn:
    """A LightningModule's ``training_step``; for a plain module ``model(batch)`` (first element of a tuple/list
    batch), its loss being the output if scalar, ``output["loss"]``/``output.loss``, or the mean of the output
    (shapes, not values, set the memory: a stand-in loss is enough)."""
    if hasattr(model, "training_step") and hasattr(model, "automatic_optimization"):
        return lightning_step(model)

    def step(batch: Any) -> Tensor:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return _loss_from(model(inputs), reduce=True)

    return step


def _resolve_measure(measure: str, device: torch.device) -> str:
    if measure == "auto":
        return "cuda" if device.type == "cuda" else "accounting"
    if measure == "cuda" and device.type != "cuda":
        raise ValueError(f"measure='cuda' needs a CUDA device, the model is on {device}.")
    return measure


def _resolve_budget(
    config: ProbeConfig, device: torch.device, measure: str, params: Sequence[Tensor], optimizers: Sequence[Any]
) -> int:
    if config.memory_budget_bytes is not None:
        return int(config.memory_budget_bytes)
    available = device_budget_bytes(device)
    if available is None:
        raise ValueError(f"cannot tell how much memory {device} has; pass memory_budget_bytes.")
    if device.type != "cuda":
        # system memory available excludes what the model already holds; the accounting counts it
        available += static_bytes(params, optimizers)
    return int(available)


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc="Probing micro-batch", unit="trial", leave=False, dynamic_ncols=True, file=sys.stderr)


def _identity(values: list[float]) -> list[float]:
    return list(values)


def _strategy_agree(trainer: "pl.Trainer") -> Agree:
    """All-reduce(MIN) through ``trainer.strategy.reduce`` (one small float64 tensor per call)."""
    if trainer.world_size <= 1:
        return _identity

    def agree(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        return trainer.strategy.reduce(tensor, reduce_op="min").cpu().tolist()

    return agree


def _dist_agree(reduce_min: Optional[Callable[[Tensor], Tensor]]) -> tuple[Agree, int, bool]:
    """``(agree, world_size, is_rank_zero)`` from ``reduce_min`` or an initialised ``torch.distributed``."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    rank_zero = not initialized or dist.get_rank() == 0
    if reduce_min is not None:
        return (lambda v: reduce_min(torch.tensor(v, dtype=torch.float64)).tolist()), world_size, rank_zero
    if world_size <= 1:
        return _identity, world_size, rank_zero

    def agree(values: list[float]) -> list[float]:
        on_cuda = dist.get_backend() == "nccl"
        tensor = torch.tensor(values, dtype=torch.float64, device="cuda" if on_cuda else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.cpu().tolist()

    return agree, world_size, rank_zero


@contextmanager
def _lightning_optimizers_quiet(trainer: "pl.Trainer") -> Iterator[None]:
    """Manual optimization: ``LightningOptimizer.step`` calls back into the loop to count steps (and so
    ``global_step``); those callbacks become no-ops while probing."""
    optimizers = list(getattr(trainer.strategy, "_lightning_optimizers", []) or [])
    saved = [(opt, opt.__dict__.get("_on_before_step"), opt.__dict__.get("_on_after_step")) for opt in optimizers]

    def nothing() -> None:
        return None

    try:
        for opt in optimizers:
            opt._on_before_step = nothing
            opt._on_after_step = nothing
        yield
    finally:
        for opt, before, after in saved:
            opt._on_before_step = before
            opt._on_after_step = after


@contextmanager
def _scaler_preserved(trainer: "pl.Trainer") -> Iterator[None]:
    """The AMP GradScaler's scale and growth tracker (manual optimization steps through it)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    saved = scaler.state_dict() if scaler is not None else {}
    try:
        yield
    finally:
        if scaler is not None and saved:
            scaler.load_state_dict(saved)


def _ddp_no_sync(trainer: "pl.Trainer") -> Any:
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer.strategy, "model", None)
    return model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()


def _check_strategy(trainer: "pl.Trainer") -> None:
    from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

    strategy = trainer.strategy
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)) or "DeepSpeed" in type(strategy).__name__:
        raise NotImplementedError(
            f"the micro-batch probe supports single-device and DDP strategies, not {type(strategy).__name__} "
            "(sharded parameters would need the strategy's own forward)."
        )


def _run(
    module: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    batch: Any,
    step: StepFn,
    config: ProbeConfig,
    *,
    device: torch.device,
    agree: Agree,
    world_size: int,
    rank_zero: bool,
    contexts: Sequence[Any] = (),
    split: Optional[tuple[int, int]] = None,
) -> ProbeResult:
    measure = _resolve_measure(config.measure, device)
    params = list({id(p): p for p in module.parameters()}.values())
    budget = _resolve_budget(config, device, measure, params, optimizers)
    split_factor = SplitFactor.find(module) if split is not None else None
    bar = _progress_bar(config.progress_bar and rank_zero)
    try:
        with ExitStack() as stack:
            for context in contexts:
                stack.enter_context(context)
            if world_size > 1:
                stack.enter_context(local_batch_norm(module))
            state = stack.enter_context(preserved_state(module, optimizers))
            runner = TrialRunner(
                module, optimizers, batch, step, device=device, measure=measure,
                limit_bytes=config.headroom * budget, config=config, state=state, split_factor=split_factor, bar=bar,
            )
            split_request = None
            if split is not None:
                split_request = (split[0], split[1], split_factor.get() if split_factor is not None else None)
            result = _search(runner, config, agree=agree, world_size=world_size, budget=budget, device=device,
                             measure=measure, split_request=split_request)
    finally:
        if bar is not None:
            bar.close()
    if config.verbose and rank_zero:
        from pytorch_lightning.utilities.rank_zero import rank_zero_info

        rank_zero_info(result.summary())
    return result


# ------------------------------------------------------------------------------------------------ public
def probe_trainer(
    trainer: "pl.Trainer",
    pl_module: "pl.LightningModule",
    batch: Any,
    *,
    memory_budget_bytes: Optional[int] = None,
    headroom: float = 0.85,
    fit_sizes: Sequence[int] = DEFAULT_FIT_SIZES,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    rel_tol: float = 0.05,
    measure: str = "auto",
    throughput: bool = True,
    throughput_sizes: Optional[Sequence[int]] = None,
    warmup_steps: int = 1,
    timed_steps: int = 3,
    search_split: bool = False,
    global_batch_size: Optional[int] = None,
    progress_bar: bool = True,
    verbose: bool = False,
) -> ProbeResult:
    """Probe from inside a fit (a callback hook), with a real ``batch`` from the train dataloader.

    Call it on every rank at the same point (e.g. ``on_train_batch_start`` of the first batch): the ranks
    agree through ``trainer.strategy.reduce(..., reduce_op="min")``. Runs ``pl_module.training_step`` (inside
    the precision plugin's autocast context), ``backward`` and ``trainer.optimizers``' ``step`` directly, so no
    Lightning hook, logger, progress bar or step counter sees a probe step; ``self.log`` calls are dropped.
    Manual optimization works (the module steps itself), but its ``manual_backward`` still calls the
    ``on_before_backward``/``on_after_backward`` hooks. Supports single-device and DDP strategies.

    Args: as :func:`probe_micro_batch`, plus
        search_split: also run the split-factor/accumulation search (:mod:`gns_callback.probe.split`) for
            ``global_batch_size`` (default: the current one, ``len(batch) × accumulate_grad_batches × world_size``),
            result in ``.split``.

    Returns:
        :class:`ProbeResult`, identical on every rank except ``.trials`` (each rank's own).
    """
    config = ProbeConfig(
        memory_budget_bytes=memory_budget_bytes, headroom=headroom, fit_sizes=tuple(fit_sizes),
        max_batch_size=max_batch_size, rel_tol=rel_tol, measure=measure, throughput=throughput,
        throughput_sizes=None if throughput_sizes is None else tuple(throughput_sizes), warmup_steps=warmup_steps,
        timed_steps=timed_steps, progress_bar=progress_bar, verbose=verbose,
    )
    _check_strategy(trainer)
    device = trainer.strategy.root_device
    batch = _move(batch, device)
    split = None
    if search_split:
        default_global = batch_size_of(batch) * trainer.accumulate_grad_batches * trainer.world_size
        split = (int(global_batch_size or default_global), int(trainer.world_size))
        per_device_batch(*split)  # fail before probing, on every rank alike
    contexts = [silenced_logging(pl_module), _lightning_optimizers_quiet(trainer), _scaler_preserved(trainer),
                _ddp_no_sync(trainer)]
    return _run(
        pl_module, list(trainer.optimizers), batch, lightning_step(pl_module, trainer), config,
        device=device, agree=_strategy_agree(trainer), world_size=trainer.world_size,
        rank_zero=trainer.is_global_zero, contexts=contexts, split=split,
    )


def probe_micro_batch(
    model: nn.Module,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None],
    batch: Any,
    step_fn: Optional[StepFn] = None,
    *,
    memory_budget_bytes: Optional[int] = None,
    headroom: float = 0.85,
    fit_sizes: Sequence[int] = DEFAULT_FIT_SIZES,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    rel_tol: float = 0.05,
    measure: str = "auto",
    throughput: bool = True,
    throughput_sizes: Optional[Sequence[int]] = None,
    warmup_steps: int = 1,
    timed_steps: int = 3,
    reduce_min: Optional[Callable[[Tensor], Tensor]] = None,
    progress_bar: bool = True,
    verbose: bool = False,
) -> ProbeResult:
    """The largest micro-batch that fits, and samples/s per micro-batch size; no Trainer needed.

    Memory is modelled as ``bytes(b) = fixed + per_sample·b`` from steps at ``fit_sizes``; the largest ``b``
    with ``bytes(b) ≤ headroom × budget`` is predicted, verified with one real step, and on failure the search
    backs off (10%, then bisection) between the largest size that worked and the smallest that failed. The
    model, optimizer state, BatchNorm statistics, ``.grad``, training flags and RNG states are exactly as
    before when it returns (also on errors).

    Args:
        model: the module whose parameters, buffers and modes are used and restored.
        optimizer: stepped once per trial (its lazily created state included in the memory), or ``None``.
        batch: one real batch; tensors whose dim 0 is its batch size are tiled to each trial size.
        step_fn: ``step_fn(batch) -> loss`` (the probe runs backward and the optimizer step), or returning
            ``None`` if it stepped itself. Default: :func:`default_step`.
        memory_budget_bytes: the budget (default: the device's free memory: CUDA free + this process's cache;
            on CPU the available system memory).
        headroom: usable fraction of the budget (allocator fragmentation, other processes, spikes).
        fit_sizes: sizes measured for the linear fit (stops at the first that fails).
        max_batch_size: upper bound on the answer (``.capped`` says when it, not memory, was the limit).
        rel_tol: bisection stops once the gap below the smallest failing size is ``≤ max(1, rel_tol·lo)``.
        measure: ``"cuda"`` (allocator peak), ``"accounting"`` (any device), ``"auto"`` (CUDA if on CUDA).
            Under the accounting, exceeding the budget counts as an OOM (a simulated one).
        throughput: time ``timed_steps`` steady-state micro-batches (after ``warmup_steps``) at
            ``throughput_sizes`` (default: the maximum and the largest powers of two below it, 4 sizes).
        reduce_min: element-wise MIN all-reduce across ranks (default: ``torch.distributed`` if initialised).
        progress_bar: a tqdm bar on rank zero while probing. verbose: log :meth:`ProbeResult.summary`.
    """
    config = ProbeConfig(
        memory_budget_bytes=memory_budget_bytes, headroom=headroom, fit_sizes=tuple(fit_sizes),
        max_batch_size=max_batch_size, rel_tol=rel_tol, measure=measure, throughput=throughput,
        throughput_sizes=None if throughput_sizes is None else tuple(throughput_sizes), warmup_steps=warmup_steps,
        timed_steps=timed_steps, progress_bar=progress_bar, verbose=verbose,
    )
    if optimizer is None:
        optimizers: list[torch.optim.Optimizer] = []
    elif isinstance(optimizer, torch.optim.Optimizer):
        optimizers = [optimizer]
    else:
        optimizers = list(optimizer)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    agree, world_size, rank_zero = _dist_agree(reduce_min)
    contexts = [silenced_logging(model)] if hasattr(model, "log") and hasattr(model, "log_dict") else []
    return _run(
        model, optimizers, _move(batch, device), step_fn or default_step(model), config,
        device=device, agree=agree, world_size=world_size, rank_zero=rank_zero, contexts=contexts,
    )


def measure_micro_batch(
    model: nn.Module,
    optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None],
    batch: Any,
    sizes: Sequence[int],
    step_fn: Optional[StepFn] = None,
    *,
    measure: str = "auto",
) -> list[Optional[int]]:
    """Bytes of one training step at each of ``sizes`` (``None`` where it ran out of memory), with the probe's
    own measurement and state restoration: memory curves, or ground truth for the probe's predictions."""
    optimizers = [] if optimizer is None else [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    config = ProbeConfig(measure=measure, progress_bar=False)
    kind = _resolve_measure(measure, device)
    contexts = [silenced_logging(model)] if hasattr(model, "log") and hasattr(model, "log_dict") else []
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        state = stack.enter_context(preserved_state(model, optimizers))
        runner = TrialRunner(model, optimizers, _move(batch, device), step_fn or default_step(model), device=device,
                             measure=kind, limit_bytes=math.inf, config=config, state=state)
        return [runner.run(int(size), "measure").measured_bytes for size in sizes]
