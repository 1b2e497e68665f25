"""The Lightning namespace in use: ``pytorch_lightning`` or the unified ``lightning.pytorch`` (or both).

Both packages ship their own ``Callback``, ``Trainer``, callbacks, strategies and exceptions, and the classes of one
are not the classes of the other: ``lightning.pytorch.Trainer`` rejects a ``pytorch_lightning.Callback``, and
``isinstance`` against one package's ``GradientAccumulationScheduler`` misses the other's. So the callback subclasses
every installed namespace's ``Callback`` (:data:`CALLBACK_BASES`), looks classes up in every namespace
(:func:`callback_types`, :func:`strategy_types`), and raises errors of the namespace whose Trainer runs it
(:func:`misconfiguration`).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")


def _installed() -> list[ModuleType]:
    found = []
    for name in NAMESPACES:
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    if not found:
        raise ImportError(
            "GradientNoiseScaleCallback needs PyTorch Lightning: pip install pytorch-lightning (or lightning). "
            "Without Lightning, use gns_callback.GradientNoiseScaleMeter in your own training loop."
        )
    return found


MODULES: list[ModuleType] = _installed()
CALLBACK_BASES: tuple[type, ...] = tuple(module.Callback for module in MODULES)


def namespace_of(trainer: Any) -> ModuleType:
    """The Lightning package whose ``Trainer`` ``trainer`` is (the first installed one if neither)."""
    for module in MODULES:
        if isinstance(trainer, module.Trainer):
            return module
    return MODULES[0]


def misconfiguration(trainer: Any, message: str) -> Exception:
    """``MisconfigurationException(message)`` of the trainer's namespace: ``lightning.fabric``'s class under
    ``lightning.pytorch``, ``lightning_fabric``'s under ``pytorch_lightning`` (each re-exported by its
    ``<namespace>.utilities.exceptions``, where users catch it)."""
    name = namespace_of(trainer).__name__
    exceptions = importlib.import_module(f"{name}.utilities.exceptions")
    return exceptions.MisconfigurationException(message)


def utility(submodule: str, name: str, trainer: Any = None) -> Any:
    """``<namespace>.<submodule>.<name>`` (e.g. ``("utilities.rank_zero", "rank_zero_info")``) of the trainer's
    namespace, or of the first installed one without a trainer: never a namespace that is not installed."""
    module = namespace_of(trainer) if trainer is not None else MODULES[0]
    return getattr(importlib.import_module(f"{module.__name__}.{submodule}"), name)


def _classes(submodule: str, name: str) -> tuple[type, ...]:
    found = []
    for module in MODULES:
        cls = getattr(importlib.import_module(f"{module.__name__}.{submodule}"), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def callback_types(name: str) -> tuple[type, ...]:
    """Callback class ``name`` (e.g. ``"GradientAccumulationScheduler"``) from every installed namespace that has
    it (empty if none)."""
    return _classes("callbacks", name)


def strategy_types(name: str) -> tuple[type, ...]:
    """Strategy class ``name`` (e.g. ``"FSDPStrategy"``) from every installed namespace that has it (empty if
    none)."""
    return _classes("strategies", name)
