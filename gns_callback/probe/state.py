"""Snapshot and restore of everything a probe step touches, so that probing changes nothing about the run.

Restored in place (the same tensor objects, so optimizers, DDP buckets and user references stay valid):
parameters and buffers (BatchNorm running statistics and ``num_batches_tracked`` included), optimizer state
(Adam's moments and step counters; state the probe created lazily is removed again) and ``param_groups``,
``.grad`` (``None`` stays ``None``), ``requires_grad``, every submodule's ``training`` flag, the RNG states
(torch CPU and CUDA, numpy, ``random``) and what a step keeps in module attributes (torchmetrics states, lists,
counters: :mod:`gns_callback.probe.attributes`). Modules the attributes hold outside the model's tree (an EMA teacher
in a plain list, updated in place by each step: :func:`~gns_callback.probe.attributes.outside_modules`) are put back
as the model's own: their parameters and buffers in place, ``.grad``, ``requires_grad`` and training flags.
Iterators in module attributes, which no copy can rewind, replay to the run what the probe steps drew from them
(:mod:`gns_callback.probe.iterators`). Copies live in host memory, not on the accelerator being probed, and
nothing goes to disk (an interrupted probe leaves no temporary checkpoint behind; Lightning's BatchSizeFinder
did).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from gns_callback.probe.attributes import AttributeState, outside_modules
from gns_callback.probe.iterators import ReplayedIterators
from gns_callback.random_streams import RNGState

_MISSING = object()


def _host_copy(tensor: Tensor) -> Tensor:
    return tensor.detach().to("cpu", copy=True)


class _Saved:
    """A value to put back: tensors in place into the original object, anything else as a deep copy."""

    __slots__ = ("original", "copy")

    def __init__(self, value: Any) -> None:
        self.original = value
        self.copy = _host_copy(value) if isinstance(value, Tensor) else copy.deepcopy(value)

    def restore(self) -> Any:
        if isinstance(self.original, Tensor):
            with torch.no_grad():
                self.original.copy_(self.copy)
            return self.original
        return copy.deepcopy(self.copy)


class OptimizerState:
    """An optimizer's per-parameter state and ``param_groups`` hyper-parameters, restorable in place."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.state = {
            param: (entry, {key: _Saved(value) for key, value in entry.items()})
            for param, entry in optimizer.state.items()
        }
        self.groups = [
            (group, {key: _Saved(value) for key, value in group.items() if key != "params"})
            for group in optimizer.param_groups
        ]
        # Set by LR schedulers' step-tracking wrapper; a probe step must not silence their ordering warning.
        self.opt_called = optimizer.__dict__.get("_opt_called", _MISSING)

    def restore(self) -> None:
        opt = self.optimizer
        for param in [p for p in opt.state if p not in self.state]:
            del opt.state[param]  # lazily created by a probe step (e.g. Adam's first step)
        for param, (entry, saved) in self.state.items():
            entry.clear()
            entry.update({key: value.restore() for key, value in saved.items()})
            opt.state[param] = entry
        for group, saved in self.groups:
            for key in [k for k in group if k != "params" and k not in saved]:
                del group[key]
            group.update({key: value.restore() for key, value in saved.items()})
        if self.opt_called is _MISSING:
            opt.__dict__.pop("_opt_called", None)
        else:
            opt.__dict__["_opt_called"] = self.opt_called


def _unique_modules(roots: Iterable[nn.Module]) -> list[nn.Module]:
    """Every module of the trees under ``roots``, once (an outside module may hold one of the model's)."""
    return list({id(sub): sub for root in roots for sub in root.modules()}.values())


class ModuleState:
    """Parameters and buffers (values and identity), ``.grad``, ``requires_grad`` and training flags of ``module``
    and of the ``outside`` modules (not in its tree, yet changed by its steps: an EMA teacher in a plain list)."""

    def __init__(self, module: nn.Module, outside: Iterable[nn.Module] = ()) -> None:
        modules = _unique_modules([module, *outside])
        copies: dict[int, Tensor] = {}  # tied weights are copied once

        def saved(tensor: Optional[Tensor]) -> Optional[Tensor]:
            if tensor is None:
                return None
            if id(tensor) not in copies:
                copies[id(tensor)] = _host_copy(tensor)
            return copies[id(tensor)]

        self.tensors = [
            (sub, registry, name, tensor, saved(tensor))
            for sub in modules
            for registry in ("_parameters", "_buffers")
            for name, tensor in getattr(sub, registry).items()
        ]
        params = {id(p): p for sub in modules for p in sub._parameters.values() if p is not None}.values()
        self.params = [(p, p.requires_grad, p.grad) for p in params]
        self.modes = [(sub, sub.training) for sub in modules]

    def restore(self) -> None:
        with torch.no_grad():
            for sub, registry, name, tensor, saved in self.tensors:
                getattr(sub, registry)[name] = tensor
                if tensor is not None:
                    tensor.copy_(saved)
        for param, requires_grad, grad in self.params:
            param.requires_grad_(requires_grad)
            param.grad = grad
        for sub, training in self.modes:
            sub.training = training


class ProbeState:
    """Everything above and the modules' attributes (:class:`~gns_callback.probe.attributes.AttributeState`,
    which takes ``**attributes``), captured at construction; :meth:`restore` may be called any number of times,
    :meth:`release` once, after the last (:class:`~gns_callback.probe.iterators.ReplayedIterators`).
    """

    def __init__(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], **attributes: Any) -> None:
        skip = attributes.get("skip", ())
        keep = [*attributes.pop("keep", ()), *optimizers]
        self.iterators = ReplayedIterators(module, skip=skip)  # before the attributes' snapshot
        self.rng = RNGState(module, skip=skip)
        # Restored in place with the model's own; to the attributes' snapshot they are shared, never copied.
        self.outside = [sub for _, sub in outside_modules(module, skip=skip, keep=keep)]
        self.module = ModuleState(module, self.outside)
        self.attributes = AttributeState(module, keep=[*keep, *self.outside], **attributes)
        self.optimizers = [OptimizerState(opt) for opt in optimizers]

    @property
    def not_restored(self) -> list[str]:
        """Attributes a step changed that could not be put back (too large or refused by ``deepcopy``)."""
        return sorted(self.attributes.not_restored)

    def restore(self) -> None:
        self.module.restore()
        self.attributes.restore()
        for opt in self.optimizers:
            opt.restore()
        self.rng.restore()
        self.iterators.rewind()

    def release(self) -> None:
        """The passes are over: iterators hand what they drew back to the run."""
        self.iterators.release()


@contextmanager
def preserved_state(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], **attributes: Any
) -> Iterator[ProbeState]:
    """``with preserved_state(model, [opt]) as state: ...``: restored on exit, also on errors and Ctrl-C."""
    state = ProbeState(module, optimizers, **attributes)
    try:
        yield state
    finally:
        state.restore()
        state.release()


@contextmanager
def local_batch_norm(module: nn.Module) -> Iterator[None]:
    """SyncBatchNorm runs as a local BatchNorm: its forward all-gathers statistics, a collective inside a trial
    that would deadlock when another rank has hit an OOM. Memory is that of the local op (the same tensors)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    patched = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm) and "forward" not in m.__dict__]
    try:
        for m in patched:
            m.forward = _BatchNorm.forward.__get__(m)  # type: ignore[method-assign]
        yield
    finally:
        for m in patched:
            m.__dict__.pop("forward", None)
