"""The Lightning adapter, the only probe module that knows Lightning: :func:`probe_trainer` (from inside a fit),
``training_step`` as a step function, ``self.log`` silenced, the strategy's reduce as the ranks' agreement,
and ``batch_split_factor`` read from an attribute or ``hparams``. Either Lightning namespace will do
(:mod:`gns_callback.lightning.compat`): it never imports ``pytorch_lightning`` by name.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, MutableMapping
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
from torch import Tensor

from gns_callback.lightning import compat
from gns_callback.probe.agreement import Agree, ProbeFailedOnOtherRank, single_process
from gns_callback.probe.batches import batch_size_of, move_batch
from gns_callback.probe.config import ProbeConfig, make_config
from gns_callback.probe.result import ProbeResult
from gns_callback.probe.oom import short_message
from gns_callback.probe.search import SplitRequest
from gns_callback.probe.session import Ranks, Session, run_probe
from gns_callback.probe.split import per_device_batch
from gns_callback.probe.state import local_batch_norm, preserved_state
from gns_callback.probe.loss import loss_from
from gns_callback.probe.trial import StepFn

if TYPE_CHECKING:
    import pytorch_lightning as pl

SPLIT_ATTRIBUTE = "batch_split_factor"
_MISSING = object()


# ---------------------------------------------------------------------------------------------- the step
def lightning_step(
    pl_module: "pl.LightningModule", trainer: Optional["pl.Trainer"] = None, batch_idx: int = 0
) -> StepFn:
    """``training_step(batch, batch_idx)`` (``batch_idx`` only if its signature has one; inside the precision
    plugin's autocast context when a Trainer is given); with manual optimization the module steps itself and
    ``None`` is returned. A step that returns ``None`` under automatic optimization (Lightning's way to skip
    a batch) raises ``TypeError``: there is nothing to measure."""
    context = trainer.precision_plugin.train_step_context if trainer is not None else nullcontext
    # as Lightning's loop does: pass batch_idx only where the signature takes it
    takes = compat.utility("utilities.signature_utils", "is_param_in_hook_signature")
    extra = (batch_idx,) if takes(pl_module.training_step, "batch_idx", min_args=2) else ()

    def step(batch: Any) -> Optional[Tensor]:
        with context():
            output = pl_module.training_step(batch, *extra)
        if not getattr(pl_module, "automatic_optimization", True):
            return None
        return loss_from(output)

    return step


@functools.lru_cache(maxsize=1)
def module_internals() -> frozenset[str]:
    """A bare LightningModule's own ``__dict__`` names (the Trainer reference, flags, caches), of every installed
    namespace: the state snapshot leaves them alone (:mod:`gns_callback.probe.attributes`)."""
    return frozenset().union(*(vars(module.LightningModule()) for module in compat.MODULES))


def _no_log(*args: Any, **kwargs: Any) -> None:
    return None


@contextmanager
def aside_from_the_run(trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> Iterator[None]:
    """Passes of ``training_step`` that are not the run's (the sharpness monitor's): ``self.log`` silenced,
    SyncBatchNorm local, and everything they touch put back (:func:`~gns_callback.probe.state.preserved_state`:
    weights, buffers, optimizer state, ``.grad``, random streams and module attributes)."""
    with silenced_logging(pl_module), local_batch_norm(pl_module), \
            preserved_state(pl_module, list(trainer.optimizers), keep=[trainer], skip=module_internals()):
        yield


@contextmanager
def silenced_logging(pl_module: Any) -> Iterator[None]:
    """``pl_module.log``/``log_dict`` become no-ops, so no value from a probe step reaches a logger or
    ``trainer.callback_metrics`` (and ``self.log`` cannot fail outside the training loop)."""
    names = ("log", "log_dict")
    previous = {name: pl_module.__dict__.get(name, _MISSING) for name in names}
    try:
        for name in names:
            setattr(pl_module, name, _no_log)
        yield
    finally:
        for name, value in previous.items():
            if value is _MISSING:
                pl_module.__dict__.pop(name, None)
            else:
                setattr(pl_module, name, value)


# ---------------------------------------------------------------------------------------------- split factor
class SplitFactor:
    """Reads and temporarily sets a LightningModule's ``batch_split_factor`` (attribute, else ``hparams`` entry)."""

    def __init__(self, owner: Any, in_hparams: bool) -> None:
        self.owner = owner
        self.in_hparams = in_hparams

    @classmethod
    def find(cls, module: Any) -> Optional["SplitFactor"]:
        """The module's own attribute (instance, class or a settable property), else its ``hparams`` entry."""
        hparams = getattr(module, "hparams", None)
        in_hparams = isinstance(hparams, Mapping) and SPLIT_ATTRIBUTE in hparams
        prop = getattr(type(module), SPLIT_ATTRIBUTE, None)
        read_only = isinstance(prop, property) and prop.fset is None
        if hasattr(module, SPLIT_ATTRIBUTE) and not (read_only and in_hparams):
            return cls(module, in_hparams=False)
        return cls(hparams, in_hparams=True) if in_hparams else None

    def get(self) -> int:
        value = self.owner[SPLIT_ATTRIBUTE] if self.in_hparams else getattr(self.owner, SPLIT_ATTRIBUTE)
        return int(value)

    def set(self, value: int) -> None:
        if self.in_hparams:
            assert isinstance(self.owner, MutableMapping)
            self.owner[SPLIT_ATTRIBUTE] = value
        else:
            setattr(self.owner, SPLIT_ATTRIBUTE, value)

    @contextmanager
    def applied(self, value: Optional[int]) -> Iterator[None]:
        """``value`` while inside (``None``: unchanged); the previous value (or its absence) after."""
        if value is None:
            yield
            return
        previous = self.owner[SPLIT_ATTRIBUTE] if self.in_hparams else getattr(self.owner, SPLIT_ATTRIBUTE)
        own = self.in_hparams or SPLIT_ATTRIBUTE in vars(self.owner) or isinstance(
            getattr(type(self.owner), SPLIT_ATTRIBUTE, None), property)
        try:
            self.set(value)
            yield
        finally:
            if self.in_hparams:
                self.owner[SPLIT_ATTRIBUTE] = previous
            elif own:
                setattr(self.owner, SPLIT_ATTRIBUTE, previous)
            else:  # a class attribute: drop the instance's shadowing copy
                delattr(self.owner, SPLIT_ATTRIBUTE)


# ---------------------------------------------------------------------------------------------- the trainer
def strategy_agree(trainer: "pl.Trainer") -> Agree:
    """All-reduce(MIN) through ``trainer.strategy.reduce`` (one small float64 tensor per call)."""
    if trainer.world_size <= 1:
        return single_process

    def agree(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=trainer.strategy.root_device)
        return trainer.strategy.reduce(tensor, reduce_op="min").cpu().tolist()

    return agree


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


def ddp_no_sync(trainer: "pl.Trainer") -> Any:
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer.strategy, "model", None)
    return model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()


def ddp_static_graph(trainer: "pl.Trainer") -> bool:
    """Whether the strategy wraps the model in ``DistributedDataParallel(static_graph=True)``. Backward passes through
    the model outside DDP's forward, before its first synchronised iteration, make DDP's reducer miss that iteration's
    record of the graph: from then on it leaves every gradient unreduced, and the ranks train apart without a word
    (or DDP stops the run, with unused parameters). Passes aside from the run must wait until after the first
    optimizer step there."""
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(trainer.strategy, "model", None)
    return isinstance(model, DistributedDataParallel) and bool(getattr(model, "static_graph", False))


def _check_strategy(trainer: "pl.Trainer") -> None:
    """Single-device and DDP strategies of either Lightning namespace (``pytorch_lightning``, ``lightning.pytorch``)."""
    from gns_callback.lightning.trainer_facts import data_parallel_strategy

    strategy = trainer.strategy
    if not data_parallel_strategy(trainer):
        raise NotImplementedError(
            f"the micro-batch probe supports single-device and DDP strategies, not {type(strategy).__name__} "
            "(sharded parameters would need the strategy's own forward)."
        )


def _split_request(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch_size: int, global_batch_size: Optional[int]
) -> SplitRequest:
    default_global = batch_size * trainer.accumulate_grad_batches * trainer.world_size
    global_batch, devices = int(global_batch_size or default_global), int(trainer.world_size)
    per_device_batch(global_batch, devices)  # fail before probing, on every rank alike
    handle = SplitFactor.find(pl_module)
    return SplitRequest(global_batch, devices, handle.get() if handle is not None else None)


def _stepped_aside(error: Exception, trainer: "pl.Trainer", config: ProbeConfig) -> ProbeResult:
    """The probe's answer when it failed for a reason other than memory: warn, and measure nothing."""
    reason = short_message(error)
    message = (f"the micro-batch probe stepped aside ({reason}); training continues unchanged and the probe "
               "result is 'not measured'.")
    if not isinstance(error, ProbeFailedOnOtherRank) or trainer.is_global_zero:  # another rank's failure: said once
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return ProbeResult.not_measured(reason, device=str(trainer.strategy.root_device), headroom=config.headroom,
                                    world_size=trainer.world_size)


def probe_trainer(
    trainer: "pl.Trainer",
    pl_module: "pl.LightningModule",
    batch: Any,
    *,
    config: Optional[ProbeConfig] = None,
    search_split: bool = False,
    global_batch_size: Optional[int] = None,
    batch_idx: int = 0,
    batch_size: Optional[int] = None,
    **settings: Any,
) -> ProbeResult:
    """Probe from inside a fit (a callback hook), with a real ``batch`` from the train dataloader.

    Call it on every rank at the same point (e.g. ``on_train_batch_start`` of the first batch): the ranks
    agree through ``trainer.strategy.reduce(..., reduce_op="min")``. Runs ``pl_module.training_step`` (inside
    the precision plugin's autocast context), ``backward`` and ``trainer.optimizers``' ``step`` directly, so no
    Lightning hook, logger, progress bar or step counter sees a probe step; ``self.log`` calls are dropped, and
    whatever the steps change in the module (weights, optimizer and metric states, lists and counters in its
    attributes, RNG) is put back. Manual optimization works (the module steps itself), but its
    ``manual_backward`` still calls the ``on_before_backward``/``on_after_backward`` hooks. Supports
    single-device and DDP strategies.

    It never ends the run: an error other than running out of memory (another strategy, a ``training_step``
    that returns ``None`` on this batch, a bug in the step) restores the state, warns once, and returns a
    result that says "not measured" (``.measured`` is False, ``.error`` the reason). Settings that make no sense
    raise ``ValueError`` before anything runs.

    Args:
        config, **settings: as :func:`~gns_callback.probe.standalone.probe_micro_batch`.
        search_split: also run the split-factor/accumulation search (:mod:`gns_callback.probe.split`) for
            ``global_batch_size`` (default: the current one, ``len(batch) × accumulate_grad_batches × world_size``),
            result in ``.split``.
        batch_idx: passed to ``training_step`` (the hook's own ``batch_idx``).
        batch_size: the examples in ``batch`` (default: the dim 0 most of its tensors share; the probe steps
            aside, saying why, where that can't be told).

    Returns:
        :class:`ProbeResult`, identical on every rank except ``.trials``, ``.wall_seconds`` and
        ``.timing_seconds`` (each rank's own).
    """
    config = make_config(config, settings)
    try:
        size = batch_size_of(batch) if batch_size is None else int(batch_size)
    except ValueError as exc:  # the batch's size can't be told: measure nothing rather than guess
        return _stepped_aside(exc, trainer, config)
    split_request = _split_request(trainer, pl_module, size, global_batch_size) if search_split else None
    try:
        result = run_probe(_session(trainer, pl_module, batch, size, search_split, batch_idx), config,
                           Ranks(strategy_agree(trainer), trainer.world_size, trainer.is_global_zero), split_request)
    except Exception as exc:  # noqa: BLE001 - the probe must not end the user's run
        return _stepped_aside(exc, trainer, config)
    if config.verbose:
        compat.utility("utilities.rank_zero", "rank_zero_info", trainer)(result.summary())
    return result


def _session(
    trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_size: int, search_split: bool,
    batch_idx: int
) -> Session:
    _check_strategy(trainer)
    device = trainer.strategy.root_device
    return Session(
        pl_module, list(trainer.optimizers), move_batch(batch, device), lightning_step(pl_module, trainer, batch_idx),
        device,
        contexts=[silenced_logging(pl_module), _lightning_optimizers_quiet(trainer), _scaler_preserved(trainer),
                  ddp_no_sync(trainer)],
        split_handle=SplitFactor.find(pl_module) if search_split else None,
        keep=[trainer],
        skip_attributes=module_internals(),
        batch_size=batch_size,
    )
