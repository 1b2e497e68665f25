"""One probe session, shared by the entry points: resolve how and against what budget to measure, hold the
state snapshot and the caller's temporary patches, and run the search.

Under DDP every rank runs its own trials with no collective inside them (the caller runs the model directly,
not through the DDP wrapper, inside ``no_sync``; SyncBatchNorm runs locally here), then the ranks agree
(:mod:`gns_callback.probe.agreement`).
"""

from __future__ import annotations

import sys
import time
import warnings
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor, nn

from gns_callback.probe.accounting import device_budget_bytes, static_bytes
from gns_callback.probe.agreement import Agree
from gns_callback.probe.attributes import describe
from gns_callback.probe.config import ProbeConfig
from gns_callback.probe.result import ProbeResult
from gns_callback.probe.search import SplitRequest, search
from gns_callback.probe.state import local_batch_norm, preserved_state
from gns_callback.probe.trial import SplitHandle, StepFn, TrialRunner, free_memory


@dataclass
class Ranks:
    """How this process takes part: ``agree`` (element-wise MIN over ranks), their number, and whether this is
    rank zero (the one that shows a progress bar)."""

    agree: Agree
    world_size: int = 1
    rank_zero: bool = True


@dataclass
class Session:
    """What a probe runs on: the module and optimizers it steps and restores, one real batch (on ``device``), the
    step function, and the caller's temporary patches (entered for the whole session)."""

    module: nn.Module
    optimizers: Sequence[torch.optim.Optimizer]
    batch: Any
    step: StepFn
    device: torch.device
    contexts: Sequence[AbstractContextManager[Any]] = field(default_factory=list)
    split_handle: Optional[SplitHandle] = None
    #: objects the module's attributes refer to that are shared, never copied (e.g. the Trainer)
    keep: Sequence[Any] = ()
    #: module ``__dict__`` names the state snapshot leaves alone (a framework's internals)
    skip_attributes: frozenset[str] = frozenset()
    #: the examples in ``batch`` (None: read off it, :func:`~gns_callback.probe.batches.batch_size_of`)
    batch_size: Optional[int] = None


def resolve_measure(measure: str, device: torch.device) -> str:
    """``"auto"`` → ``"cuda"`` on CUDA, else ``"accounting"``; ``"cuda"`` off CUDA is an error."""
    if measure == "auto":
        return "cuda" if device.type == "cuda" else "accounting"
    if measure == "cuda" and device.type != "cuda":
        raise ValueError(f"measure='cuda' needs a CUDA device, the model is on {device}; use 'accounting' or 'auto'.")
    return measure


def resolve_budget(
    config: ProbeConfig, device: torch.device, params: Sequence[Tensor], optimizers: Sequence[Any]
) -> int:
    """``config.memory_budget_bytes``, else what the device has (on CPU plus what the model already holds:
    available system memory excludes it, the accounting counts it)."""
    if config.memory_budget_bytes is not None:
        return int(config.memory_budget_bytes)
    available = device_budget_bytes(device)
    if available is None:
        raise ValueError(f"cannot tell how much memory {device} has; pass memory_budget_bytes.")
    if device.type != "cuda":
        available += static_bytes(params, optimizers)
    return int(available)


def _progress_bar(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(desc="Probing micro-batch", unit="trial", leave=False, dynamic_ncols=True, file=sys.stderr)


def _warn_not_restored(names: list[str]) -> None:
    if names:
        warnings.warn(
            f"the micro-batch probe changed module attribute(s) {describe(names)} and could not put them back "
            "(too large to copy, or not copyable); raise ProbeConfig.max_copy_bytes, or keep that state elsewhere.",
            RuntimeWarning, stacklevel=3,
        )


def run_probe(
    session: Session, config: ProbeConfig, ranks: Ranks, split_request: Optional[SplitRequest] = None
) -> ProbeResult:
    """Search with every piece of state restored on exit (also on errors and Ctrl-C)."""
    started = time.perf_counter()
    measure = resolve_measure(config.measure, session.device)
    if measure == "cuda":  # tensors of earlier runs held only by reference cycles would count in every peak
        free_memory(session.device, after_failure=True)
    params = list({id(p): p for p in session.module.parameters()}.values())
    budget = resolve_budget(config, session.device, params, session.optimizers)
    bar = _progress_bar(config.progress_bar and ranks.rank_zero)
    try:
        with ExitStack() as stack:
            for context in session.contexts:
                stack.enter_context(context)
            if ranks.world_size > 1:
                stack.enter_context(local_batch_norm(session.module))
            state = stack.enter_context(preserved_state(
                session.module, session.optimizers, keep=session.keep, skip=session.skip_attributes,
                max_copy_bytes=config.max_copy_bytes,
            ))
            runner = TrialRunner(
                session.module, session.optimizers, session.batch, session.step, device=session.device,
                measure=measure, limit_bytes=config.headroom * budget, config=config, state=state,
                split_handle=session.split_handle, bar=bar, batch_size=session.batch_size,
            )
            result = search(runner, config, agree=ranks.agree, world_size=ranks.world_size, budget=budget,
                            split_request=split_request)
    finally:
        if bar is not None:
            bar.close()
    result.not_restored = state.not_restored  # read after the final restore
    result.wall_seconds = time.perf_counter() - started
    _warn_not_restored(result.not_restored)
    return result
