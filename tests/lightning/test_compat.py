"""Both Lightning namespaces: one callback class for either Trainer, errors and classes of the namespace in use."""

from __future__ import annotations

from gns_callback import GradientNoiseScaleCallback
from gns_callback.lightning import compat


def test_the_callback_is_a_callback_of_every_installed_namespace(namespace):
    assert issubclass(GradientNoiseScaleCallback, namespace.module.Callback)
    assert namespace.module.Callback in compat.CALLBACK_BASES


def test_namespace_of_a_trainer(namespace):
    assert compat.namespace_of(namespace.trainer()) is namespace.module


def test_errors_are_of_the_trainer_namespace(namespace, other_namespace):
    error = compat.misconfiguration(namespace.trainer(), "the message")
    assert isinstance(error, namespace.MisconfigurationException) and str(error) == "the message"
    # the two namespaces' classes differ (lightning.fabric's vs lightning_fabric's): the other one must not be used
    assert other_namespace.MisconfigurationException is not namespace.MisconfigurationException
    assert not isinstance(error, other_namespace.MisconfigurationException)


def test_classes_are_found_in_every_installed_namespace(namespace):
    callbacks, strategies = namespace.sub("callbacks"), namespace.sub("strategies")
    assert callbacks.GradientAccumulationScheduler in compat.callback_types("GradientAccumulationScheduler")
    assert strategies.FSDPStrategy in compat.strategy_types("FSDPStrategy")
    assert len(compat.strategy_types("DDPStrategy")) == len(compat.MODULES)


def test_a_class_no_namespace_has_is_an_empty_tuple():
    assert compat.strategy_types("NoSuchStrategy") == ()
    assert compat.callback_types("NoSuchCallback") == ()
