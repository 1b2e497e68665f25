"""What the callback reads off a Lightning ``Trainer`` (read-only; each function one fact)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Sampler

from gns_callback.lightning.compat import callback_types, namespace_of, strategy_types
from gns_callback.sampling import loader_sampler


def loss_scale(trainer: Any) -> Optional[torch.Tensor]:
    """The AMP GradScaler's current scale as a tensor (no host sync), or None without a scaler."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not scaler.is_enabled():
        return None
    scale = getattr(scaler, "_scale", None)
    return scale if isinstance(scale, torch.Tensor) else torch.tensor(scaler.get_scale())


def sum_across_ranks(trainer: Any) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The strategy's sum over data-parallel ranks, or None on one process."""
    if trainer.world_size <= 1:
        return None
    return lambda tensor: trainer.strategy.reduce(tensor, reduce_op="sum")


def accumulation_schedule(trainer: Any) -> Optional[dict[int, int]]:
    """``{epoch: accumulate}`` of a ``GradientAccumulationScheduler`` (either Lightning namespace), or None."""
    types = callback_types("GradientAccumulationScheduler")
    for callback in trainer.callbacks:
        if isinstance(callback, types):
            return dict(callback.scheduling)
    return None


def has_callback(trainer: Any, name: str) -> bool:
    """Whether one of ``trainer``'s callbacks is Lightning's callback class ``name`` (either namespace)."""
    types = callback_types(name)
    return any(isinstance(callback, types) for callback in trainer.callbacks)


#: Strategies that split parameters, gradients or optimizer state across ranks (by class name, looked up in every
#: installed namespace): no rank's ``.grad`` holds the whole gradient, and DeepSpeed's engine also runs backward
#: and accumulation itself.
SHARDED_STRATEGIES = ("FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy")

#: Strategies whose ranks each hold the whole gradient, averaged over ranks before the optimizer step (DDP and
#: its subclasses, e.g. XLA's; one device). DeepSpeed subclasses DDP but is sharded: see SHARDED_STRATEGIES.
DATA_PARALLEL_STRATEGIES = ("SingleDeviceStrategy", "DDPStrategy")


def sharded_strategy(trainer: Any) -> Optional[str]:
    """The name of the Lightning strategy class in :data:`SHARDED_STRATEGIES` that ``trainer.strategy`` is an
    instance of (either namespace, subclasses included), or None."""
    for name in SHARDED_STRATEGIES:
        if isinstance(trainer.strategy, strategy_types(name)):
            return name
    return None


def data_parallel_strategy(trainer: Any) -> bool:
    """Whether every rank holds the whole gradient: one of :data:`DATA_PARALLEL_STRATEGIES` and not sharded."""
    types = tuple(cls for name in DATA_PARALLEL_STRATEGIES for cls in strategy_types(name))
    return isinstance(trainer.strategy, types) and sharded_strategy(trainer) is None


def on_accelerator(trainer: Any) -> bool:
    """The run trains on a device other than the CPU (CUDA, MPS, XLA, ...)."""
    device = getattr(trainer.strategy, "root_device", None)
    return device is not None and getattr(device, "type", "cpu") != "cpu"


def progress_bar_enabled(trainer: Any) -> bool:
    """Whether the Trainer shows a progress bar (``enable_progress_bar``): other progress output follows it, as
    Lightning's tuner does."""
    return getattr(trainer, "progress_bar_callback", None) is not None


def several_micro_batches(trainer: Any) -> bool:
    """Whether optimizer steps have more than one backward pass anywhere (accumulation or several ranks)."""
    schedule = accumulation_schedule(trainer) or {}
    return trainer.world_size * trainer.accumulate_grad_batches > 1 or any(v > 1 for v in schedule.values())


def compiled_whole(pl_module: Any) -> bool:
    """Whether ``torch.compile(module)`` was handed to ``Trainer.fit``: Lightning then compiles ``forward`` and
    ``training_step`` of the module itself, which its submodules don't show."""
    return getattr(pl_module, "_compiler_ctx", None) is not None


def loader_batch_size(trainer: Any) -> tuple[Optional[int], Optional[int]]:
    """The training DataLoader's ``batch_size`` and the length of its sampler (None where either can't be read: a
    ``batch_sampler``, ``batch_size=None``, an iterable dataset's sampler)."""
    loader = getattr(trainer, "train_dataloader", None)
    size = getattr(loader, "batch_size", None)
    try:
        drawn = len(loader.sampler)
    except (AttributeError, TypeError):
        drawn = None
    return (size if isinstance(size, int) else None), drawn


def dataset_size(trainer: Any) -> Optional[int]:
    try:
        return len(trainer.train_dataloader.dataset)
    except (AttributeError, TypeError):
        return None


def combined_train_loaders(trainer: Any) -> tuple[int, Optional[str]]:
    """How many training DataLoaders Lightning combines into each batch (a dict or list of them returned by
    ``train_dataloader``), and its ``CombinedLoader``'s mode (None where it can't be read)."""
    iterables = getattr(trainer, "train_dataloader", None)
    count = len(iterables) if isinstance(iterables, (Mapping, list, tuple)) else 1
    combined = getattr(getattr(trainer, "fit_loop", None), "_combined_loader", None)
    return count, getattr(combined, "_mode", None)


def train_sampler(trainer: Any) -> Optional[Sampler]:
    """The sampler behind the training DataLoader's batches (None: several loaders, an iterable data set, or a custom
    batch sampler, whose draws can't be told)."""
    return loader_sampler(getattr(trainer, "train_dataloader", None))


def steps_per_epoch(trainer: Any) -> Optional[int]:
    batches = trainer.num_training_batches
    if not isinstance(batches, int) or batches <= 0:
        return None
    return math.ceil(batches / trainer.accumulate_grad_batches)


def group_base_lrs(trainer: Any) -> list[float]:
    """The first optimizer's param groups' LRs before any schedule (``initial_lr`` where a scheduler set one); empty
    without an optimizer."""
    if not trainer.optimizers:
        return []
    return [float(group.get("initial_lr", group["lr"])) for group in trainer.optimizers[0].param_groups]


def base_lr(trainer: Any) -> Optional[float]:
    """The largest of :func:`group_base_lrs` (None without an optimizer). A new LR scales every group by one factor,
    so the largest is the one the stability limit binds; a group held at LR 0 (a frozen backbone) is not taken for
    the run's LR. Before, the first group's was taken: with groups at LRs 0 and 0.4 the recommended LR was 0, and
    its stability limit was never applied."""
    lrs = group_base_lrs(trainer)
    return max(lrs) if lrs else None


def say(trainer: Any, message: str) -> None:
    """Print ``message`` on rank zero through the Lightning namespace's own console logger."""
    if trainer.is_global_zero:
        logging.getLogger(f"{namespace_of(trainer).__name__}.callbacks.gns").info(message)


def peak_lr_schedule(trainer: Any) -> Optional[tuple[str, list[float]]]:
    """The first optimizer's scheduler that sets the LR outright at every step from peaks of its own (``OneCycleLR``'s
    ``max_lr``, ``CyclicLR``'s ``max_lr``): its class name and those peaks, one per parameter group; None otherwise.
    A recommended LR is then applied by scaling the peaks, not the optimizer's ``lr``."""
    if not trainer.optimizers:
        return None
    for config in getattr(trainer, "lr_scheduler_configs", None) or []:
        scheduler = config.scheduler
        if getattr(scheduler, "optimizer", None) is not trainer.optimizers[0]:
            continue
        if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
            return "OneCycleLR", [float(group["max_lr"]) for group in scheduler.optimizer.param_groups]
        if isinstance(scheduler, torch.optim.lr_scheduler.CyclicLR):
            return "CyclicLR", [float(lr) for lr in scheduler.max_lrs]
    return None
