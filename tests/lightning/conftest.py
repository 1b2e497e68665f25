"""The Lightning namespace under test: ``pytorch_lightning`` and the unified ``lightning.pytorch``.

Tests that take the ``namespace`` fixture run once per namespace, with that namespace's Trainer, callbacks,
loggers, strategies, exceptions and LightningCLI. A namespace that is not installed is skipped with how to install
it (the test extra, ``pip install -e ".[test]"``, installs both).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest

from gns_callback.lightning.compat import NAMESPACES
from tests.lightning.modules import digits_classifier


@dataclass(frozen=True)
class Namespace:
    """One Lightning namespace, and what the tests build from it."""

    name: str
    module: ModuleType

    def sub(self, path: str) -> ModuleType:
        """``<namespace>.<path>``, e.g. ``sub("callbacks")``."""
        return importlib.import_module(f"{self.name}.{path}")

    @property
    def MisconfigurationException(self) -> type:
        return self.sub("utilities.exceptions").MisconfigurationException

    def trainer(self, **kwargs: Any) -> Any:
        """A CPU Trainer with no logger, checkpointing, progress bar or model summary (unless overridden)."""
        settings = dict(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
        settings.update(kwargs)
        return self.module.Trainer(**settings)

    def classifier(self, **kwargs: Any) -> Any:
        """A ``DigitsClassifier`` (:mod:`tests.lightning.modules`) of this namespace."""
        return digits_classifier(self.name)(**kwargs)


def load_namespace(name: str) -> Namespace:
    try:
        return Namespace(name, importlib.import_module(name))
    except ImportError:
        package = name.split(".")[0].replace("_", "-")
        pytest.skip(f"{name} is not installed: pip install {package} (the test extra installs both namespaces)")


@pytest.fixture(params=NAMESPACES)
def namespace(request) -> Namespace:
    return load_namespace(request.param)


@pytest.fixture
def other_namespace(namespace) -> Namespace:
    """The namespace that is not under test (for checks that its classes are *not* used)."""
    (other,) = [name for name in NAMESPACES if name != namespace.name]
    return load_namespace(other)
