"""The Lightning namespace in use: ``pytorch_lightning`` or the unified ``lightning.pytorch`` (or both).

Both packages ship their own ``Callback`` class and exceptions; the Trainer of either only accepts its own. The
callback subclasses every installed namespace's ``Callback`` (:data:`CALLBACK_BASES`), and raises errors of the
namespace whose Trainer runs it (:func:`misconfiguration`).
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


MODULES = _installed()
CALLBACK_BASES: tuple[type, ...] = tuple(module.Callback for module in MODULES)


def namespace_of(trainer: Any) -> ModuleType:
    """The Lightning package whose ``Trainer`` ``trainer`` is (the first installed one if unknown)."""
    for module in MODULES:
        if isinstance(trainer, module.Trainer):
            return module
    return MODULES[0]


def misconfiguration(trainer: Any, message: str) -> Exception:
    """A ``MisconfigurationException`` of the trainer's namespace (``lightning_fabric``'s under ``lightning``)."""
    name = namespace_of(trainer).__name__
    exceptions = importlib.import_module(f"{name}.utilities.exceptions")
    return exceptions.MisconfigurationException(message)


def callback_types(trainer: Any, name: str) -> tuple[type, ...]:
    """``name`` (e.g. ``"GradientAccumulationScheduler"``) from every installed namespace's ``callbacks``."""
    found = []
    for module in MODULES:
        cls = getattr(importlib.import_module(f"{module.__name__}.callbacks"), name, None)
        if cls is not None:
            found.append(cls)
    return tuple(found)


def strategy_types(name: str) -> tuple[type, ...]:
    """Strategy class ``name`` (e.g. ``"FSDPStrategy"``) from every installed namespace that has it."""
    found = []
    for module in MODULES:
        cls = getattr(importlib.import_module(f"{module.__name__}.strategies"), name, None)
        if cls is not None:
            found.append(cls)
    return tuple(found)
