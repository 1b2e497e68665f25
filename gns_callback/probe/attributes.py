"""Snapshot and restore of the state a ``training_step`` keeps in module attributes, outside parameters and
buffers: torchmetrics ``Metric`` states (their tensors, lists, update counts and cached ``compute``), and plain
Python values the user mutates (lists of outputs, dicts, counters).

Every entry of every submodule's ``__dict__`` is covered, except torch's own (``_parameters``, hooks,
``training``; restored elsewhere or never changed by a step) and ``skip`` names given by the caller (a
framework's internals). An entry is restored only if it changed: a fingerprint (identity, length, tensor
version counters, recursively) is compared, so unchanged values keep their identity. A changed entry gets its
original object back, its contents restored in place where it is a tensor, list, dict, set or plain object (so
other references to it see the restored value), else a fresh copy.

The model's own modules, parameters and buffers (and objects the caller keeps, with the modules, parameters and
buffers of kept modules) are shared, never copied: inside an entry they count by identity alone (an entry that is
itself a kept object is restored in place as any other). Modules held outside the model's tree (an EMA teacher in a
plain list: :func:`outside_modules`) are kept so by :class:`~gns_callback.probe.state.ProbeState`, which puts their
parameters and buffers back in place as the model's own.
So a list that holds parameters (``nn.LSTM._flat_weights``, which the fused kernel reads its weights from) is
unchanged when a step updates the parameters in place, and is never restored to copies of them: that cut an
LSTM's weights off from their gradients for the rest of the run.

Copies live in host memory (tensors, also inside lists, tuples and dicts, which are put back in place where a
step changed them, so that other references to them see it); objects holding device tensors and
entries larger than ``max_copy_bytes`` are not copied, only fingerprinted. Such an entry, or one ``deepcopy``
refuses, is reported by name in :attr:`AttributeState.not_restored` if (and only if) a step changed it.
"""

from __future__ import annotations

import copy
import inspect
from collections import deque
from collections.abc import Collection, Hashable
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np
import torch
from torch import Tensor, nn

from gns_callback.random_streams import TORCH_INTERNALS, attribute_objects, module_generators

_ATOMS = (type(None), bool, int, float, complex, str, bytes, range, torch.device, torch.dtype)
_MAX_DEPTH = 6
_MAX_NODES = 100_000


class _Walk:
    """One pass over a value: its fingerprint, the bytes of the arrays in it, and whether an object (not a
    plain container) holds a non-CPU tensor (a deep copy would put it on the device being probed)."""

    def __init__(self, shared: Collection[int] = frozenset()) -> None:
        self.shared = shared  # ids of objects that count by identity alone
        self.nodes = 0
        self.nbytes = 0
        self.device_tensor_in_object = False
        self.complete = True

    def __call__(self, value: Any, depth: int = 0, in_object: bool = False) -> Hashable:
        self.nodes += 1
        if isinstance(value, _ATOMS):
            return ("value", value)
        if depth and id(value) in self.shared:
            return ("shared", id(value))
        if depth > _MAX_DEPTH or self.nodes > _MAX_NODES:
            self.complete = False
            return ("opaque", id(value))
        if isinstance(value, Tensor):
            return self._tensor(value, in_object)
        if isinstance(value, np.ndarray):
            self.nbytes += value.nbytes
            return ("array", id(value), value.shape, value.tobytes() if value.nbytes <= 4096 else value.nbytes)
        return self._composite(value, depth, in_object)

    def _tensor(self, tensor: Tensor, in_object: bool) -> Hashable:
        self.nbytes += tensor.numel() * tensor.element_size()
        self.device_tensor_in_object |= in_object and tensor.device.type != "cpu"
        return ("tensor", id(tensor), tensor._version, tuple(tensor.shape), tensor.dtype)

    def _composite(self, value: Any, depth: int, in_object: bool) -> Hashable:
        if isinstance(value, (list, tuple, deque)):
            return (type(value), id(value), tuple(self(v, depth + 1, in_object) for v in value))
        if isinstance(value, (set, frozenset)):
            return (type(value), id(value), frozenset(self(v, depth + 1, in_object) for v in value))
        if isinstance(value, dict):
            items = tuple((self(k, depth + 1), self(v, depth + 1, in_object)) for k, v in value.items())
            return (type(value), id(value), items)
        if isinstance(value, (nn.Module, type)) or inspect.isroutine(value) or not hasattr(value, "__dict__"):
            return ("object", id(value))  # modules are covered entry by entry, or kept; functions don't change
        return (type(value), id(value), self(vars(value), depth + 1, in_object=True))


class _HostTensor:
    """A tensor's host copy, and where it came from: the original tensor, its version counter and its flags."""

    __slots__ = ("original", "version", "data", "device", "requires_grad")

    def __init__(self, tensor: Tensor) -> None:
        self.original = tensor
        self.version = tensor._version
        self.data = tensor.detach().to("cpu", copy=True)
        self.device = tensor.device
        self.requires_grad = tensor.requires_grad

    def back(self) -> Tensor:
        """The original tensor with its saved values (in place: other references to it see them), or a fresh one
        where the step changed its shape, dtype, device or ``requires_grad``."""
        original = self.original
        if (original.shape != self.data.shape or original.dtype != self.data.dtype or original.device != self.device
                or original.requires_grad != self.requires_grad):
            tensor = self.data.to(self.device, copy=True)
            return tensor.requires_grad_() if self.requires_grad else tensor
        if original._version != self.version:
            with torch.no_grad():
                original.copy_(self.data)
        return original


def _plain(value: Any) -> bool:
    return type(value) in (list, tuple, dict, set, frozenset)


def _save(value: Any, memo: dict[int, Any], nested: bool = False) -> Any:
    """A host copy: tensors (also inside plain lists, tuples, dicts, sets) to host memory, the rest ``deepcopy``;
    shared objects (``memo``) inside it as they are."""
    if nested and id(value) in memo:
        return value
    if isinstance(value, Tensor):
        return _HostTensor(value)
    if type(value) is dict:
        return {k: _save(v, memo, True) for k, v in value.items()}
    if _plain(value):
        return type(value)(_save(v, memo, True) for v in value)
    return copy.deepcopy(value, dict(memo))


def _load(saved: Any, memo: dict[int, Any], nested: bool = False) -> Any:
    """A fresh value from :func:`_save`'s copy (the copy itself stays untouched for the next restore)."""
    if nested and id(saved) in memo:
        return saved
    if isinstance(saved, _HostTensor):
        return saved.back()
    if type(saved) is dict:
        return {k: _load(v, memo, True) for k, v in saved.items()}
    if _plain(saved):
        return type(saved)(_load(v, memo, True) for v in saved)
    return copy.deepcopy(saved, dict(memo))


def _restore_into(original: Any, fresh: Any) -> bool:
    """Put ``fresh``'s contents into ``original`` in place; False where that is not possible."""
    if fresh is original:  # a tensor :meth:`_HostTensor.back` put back in place
        return True
    if isinstance(original, Tensor):
        if not isinstance(fresh, Tensor) or fresh.shape != original.shape or fresh.dtype != original.dtype:
            return False
        with torch.no_grad():
            original.copy_(fresh)
    elif isinstance(original, list):
        original[:] = fresh
    elif isinstance(original, deque):
        original.clear()
        original.extend(fresh)
    elif isinstance(original, (dict, set)):
        original.clear()
        original.update(fresh)
    elif type(original) is type(fresh) and hasattr(original, "__dict__") and not isinstance(original, nn.Module):
        vars(original).clear()
        vars(original).update(vars(fresh))
    else:
        return False
    return True


_MISSING = object()


@dataclass
class _Entry:
    """One ``__dict__`` entry at snapshot time."""

    owner: nn.Module
    name: str  # for messages: "net.metric.tp"
    key: str
    original: Any
    fingerprint: Hashable
    saved: Any = _MISSING  # _MISSING: not copied (too large, on a device inside an object, or refused)


def _module_objects(module: nn.Module) -> list[Any]:
    """A module's submodules, parameters and buffers: what a snapshot shares by identity."""
    return [*module.modules(), *module.parameters(), *module.buffers()]


def outside_modules(module: nn.Module, skip: Iterable[str] = (),
                    keep: Iterable[Any] = ()) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for each module that the attributes of ``module`` and its submodules hold outside its
    tree: inside a list, tuple, dict or plain object, a few levels down (the bounded walk of
    :func:`~gns_callback.random_streams.attribute_objects`). An EMA or mean-teacher network kept as
    ``self.teacher = [copy.deepcopy(self.net)]`` is one: no submodule, so in no ``state_dict``, no optimizer and no
    ``module.modules()``, yet a step may update it in place, and a snapshot must copy and put back its tensors too.
    ``keep`` objects (a Trainer) are neither returned nor walked into; ``skip``: attribute names left alone."""
    tree = {id(sub) for sub in module.modules()}
    keep = list(keep)
    kept = {id(obj) for obj in keep}

    def outside(value: Any) -> bool:
        return isinstance(value, nn.Module) and id(value) not in tree and id(value) not in kept

    return attribute_objects(module, outside, skip, stop=keep)


class AttributeState:
    """The attribute entries of ``module`` and its submodules (see the module docstring).

    Args:
        keep: objects referenced from the state that stay shared, never copied (e.g. a Trainer, a module outside
            the tree); the modules, parameters and buffers of ``module`` and of kept modules always are.
        skip: ``__dict__`` names left alone (a framework's internals).
        max_copy_bytes: entries holding more tensor/array bytes than this are fingerprinted, not copied.
    """

    def __init__(self, module: nn.Module, *, keep: Iterable[Any] = (), skip: Iterable[str] = (),
                 max_copy_bytes: float = 2**29) -> None:
        # Generators too: a copy would lose their state (RNGState puts it back in place, probe/state.py).
        generators = [gen for _, gen in module_generators(module, skip)]
        keep = list(keep)
        trees = [module, *(obj for obj in keep if isinstance(obj, nn.Module))]
        shared = [*generators, *keep, *(obj for tree in trees for obj in _module_objects(tree))]
        self._memo = {id(obj): obj for obj in shared}
        self._skip = TORCH_INTERNALS | set(skip)
        self.max_copy_bytes = max_copy_bytes
        self.entries = [
            self._entry(sub, prefix, key) for prefix, sub in module.named_modules() for key in self._keys(sub)
        ]
        self._present = {id(sub): set(self._keys(sub)) for sub in module.modules()}
        self._modules = list(module.modules())
        self.not_restored: set[str] = set()

    def _keys(self, module: nn.Module) -> list[str]:
        return [key for key in vars(module) if key not in self._skip]

    def _entry(self, owner: nn.Module, prefix: str, key: str) -> _Entry:
        value = vars(owner)[key]
        walk = _Walk(self._memo)
        entry = _Entry(owner, f"{prefix}.{key}" if prefix else key, key, value, walk(value))
        if walk.nbytes <= self.max_copy_bytes and not walk.device_tensor_in_object:
            try:
                entry.saved = _save(value, self._memo)
            except Exception:  # noqa: BLE001 - anything deepcopy refuses: fingerprint only
                pass
        return entry

    def _fingerprint(self, value: Any) -> Hashable:
        return _Walk(self._memo)(value)

    def restore(self) -> None:
        """Changed entries back, entries a step added removed; unrestorable changes go to ``not_restored``."""
        for entry in self.entries:
            self._restore_entry(entry)
        for module in self._modules:
            for key in set(self._keys(module)) - self._present[id(module)]:
                del vars(module)[key]

    def _restore_entry(self, entry: _Entry) -> None:
        attributes = vars(entry.owner)
        unchanged = self._fingerprint(entry.original) == entry.fingerprint
        if attributes.get(entry.key, _MISSING) is entry.original and unchanged:
            return
        attributes[entry.key] = entry.original  # the original object: other references to it stay valid
        if unchanged:
            return  # the step replaced it, the original itself is unchanged
        if entry.saved is _MISSING:
            self.not_restored.add(entry.name)
            return
        fresh = _load(entry.saved, self._memo)
        if not _restore_into(entry.original, fresh):
            attributes[entry.key] = fresh
            entry.original = fresh
        entry.fingerprint = self._fingerprint(entry.original)  # equal in value to the snapshot again


def describe(names: Optional[Iterable[str]]) -> str:
    """``"a, b and 3 more"`` for a warning."""
    names = sorted(names or ())
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
