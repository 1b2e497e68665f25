"""The probe without a Trainer: :func:`probe_micro_batch` and :func:`measure_micro_batch` (no Lightning import).

A LightningModule passed without a step function is stepped through its ``training_step`` by the Lightning
adapter (:mod:`gns_callback.probe.lightning`), imported only then.
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager, ExitStack
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from gns_callback.probe.agreement import single_process
from gns_callback.probe.batches import move_batch
from gns_callback.probe.config import ProbeConfig, make_config
from gns_callback.probe.loss import loss_from
from gns_callback.probe.result import ProbeResult
from gns_callback.probe.session import Ranks, Session, resolve_measure, run_probe
from gns_callback.probe.state import preserved_state
from gns_callback.probe.trial import StepFn, TrialRunner

log = logging.getLogger(__name__)

Optimizers = Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None]


def _is_lightning_module(model: nn.Module) -> bool:
    return all(hasattr(model, name) for name in ("training_step", "automatic_optimization", "log", "log_dict"))


def default_step(model: nn.Module) -> StepFn:
    """A LightningModule's ``training_step``; for a plain module ``model(batch)`` (first element of a tuple/list
    batch), its loss being the output if scalar, ``output["loss"]``/``output.loss``, or the mean of the output
    (shapes, not values, set the memory: a stand-in loss is enough)."""
    if _is_lightning_module(model):
        from gns_callback.probe.lightning import lightning_step

        return lightning_step(model)

    def step(batch: Any) -> Tensor:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return loss_from(model(inputs), reduce=True)

    return step


def _lightning_parts(model: nn.Module) -> tuple[list[AbstractContextManager[Any]], frozenset[str]]:
    """For a LightningModule: ``self.log`` silenced (without a Trainer it would raise), and its internal
    attributes left out of the state snapshot."""
    if not _is_lightning_module(model):
        return [], frozenset()
    from gns_callback.probe.lightning import module_internals, silenced_logging

    return [silenced_logging(model)], module_internals()


def _optimizer_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _device_of(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def distributed_ranks(reduce_min: Optional[Callable[[Tensor], Tensor]] = None) -> Ranks:
    """The ranks of an initialised ``torch.distributed`` group (one process otherwise); ``reduce_min``, an
    element-wise MIN all-reduce of a float64 tensor, replaces the collective if given."""
    import torch.distributed as dist

    initialized = dist.is_available() and dist.is_initialized()
    world_size = dist.get_world_size() if initialized else 1
    rank_zero = not initialized or dist.get_rank() == 0
    if reduce_min is not None:
        return Ranks(lambda v: reduce_min(torch.tensor(v, dtype=torch.float64)).tolist(), world_size, rank_zero)
    if world_size <= 1:
        return Ranks(single_process, world_size, rank_zero)

    def agree(values: list[float]) -> list[float]:
        on_cuda = dist.get_backend() == "nccl"
        tensor = torch.tensor(values, dtype=torch.float64, device="cuda" if on_cuda else "cpu")
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return tensor.cpu().tolist()

    return Ranks(agree, world_size, rank_zero)


def probe_micro_batch(
    model: nn.Module,
    optimizer: Optimizers,
    batch: Any,
    step_fn: Optional[StepFn] = None,
    *,
    config: Optional[ProbeConfig] = None,
    reduce_min: Optional[Callable[[Tensor], Tensor]] = None,
    batch_size: Optional[int] = None,
    **settings: Any,
) -> ProbeResult:
    """The largest micro-batch that fits, and samples/s per micro-batch size; no Trainer needed.

    Memory is modelled as ``bytes(b) = fixed + per_sample·b`` from steps at ``fit_sizes``; the largest ``b``
    with ``bytes(b) ≤ headroom × budget`` is predicted and verified with real steps (two on CUDA), extended
    upward by the secant while it ran well under the limit, and on failure the search backs off (2.5%, then 10%,
    then bisection) between the largest size that worked and the smallest that failed. The
    model, optimizer state, BatchNorm statistics, ``.grad``, training flags and RNG states are exactly as
    before when it returns (also on errors, which propagate).

    Args:
        model: the module whose parameters, buffers and modes are used and restored.
        optimizer: stepped once per trial (its lazily created state included in the memory), or ``None``.
        batch: one real batch; tensors whose dim 0 is its batch size are tiled to each trial size.
        step_fn: ``step_fn(batch) -> loss`` (the probe runs backward and the optimizer step), or returning
            ``None`` if it stepped itself. Default: :func:`default_step`.
        config: the settings (:class:`~gns_callback.probe.config.ProbeConfig`); ``**settings`` override its
            fields by name (``memory_budget_bytes=..., headroom=..., throughput_sizes=...``).
        reduce_min: element-wise MIN all-reduce across ranks (default: ``torch.distributed`` if initialised).
        batch_size: the examples in ``batch`` (default: the dim 0 most of its tensors share; ``ValueError`` where
            that can't be told).
    """
    config = make_config(config, settings)
    device = _device_of(model)
    contexts, internals = _lightning_parts(model)
    session = Session(model, _optimizer_list(optimizer), move_batch(batch, device), step_fn or default_step(model),
                      device, contexts=contexts, skip_attributes=internals, batch_size=batch_size)
    ranks = distributed_ranks(reduce_min)
    result = run_probe(session, config, ranks)
    if config.verbose and ranks.rank_zero:
        log.info(result.summary())
    return result


def measure_micro_batch(
    model: nn.Module,
    optimizer: Optimizers,
    batch: Any,
    sizes: Sequence[int],
    step_fn: Optional[StepFn] = None,
    *,
    measure: str = "auto",
) -> list[Optional[int]]:
    """Bytes of one training step at each of ``sizes`` (``None`` where it ran out of memory), with the probe's
    own measurement and state restoration: memory curves, or ground truth for the probe's predictions."""
    optimizers = _optimizer_list(optimizer)
    device = _device_of(model)
    config = make_config(None, {"measure": measure, "progress_bar": False})
    contexts, internals = _lightning_parts(model)
    with ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        state = stack.enter_context(preserved_state(model, optimizers, skip=internals))
        runner = TrialRunner(model, optimizers, move_batch(batch, device), step_fn or default_step(model),
                             device=device, measure=resolve_measure(measure, device), limit_bytes=math.inf,
                             config=config, state=state)
        return [runner.run(int(size), "measure").measured_bytes for size in sizes]
