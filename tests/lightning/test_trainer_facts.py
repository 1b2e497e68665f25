"""Facts read off a Trainer of either namespace: the accumulation schedule, the kind of strategy, the progress bar."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from gns_callback.lightning import trainer_facts as facts


def test_either_namespace_accumulation_scheduler_is_recognised(namespace):
    scheduler = namespace.sub("callbacks").GradientAccumulationScheduler({0: 1, 2: 4})
    trainer = namespace.trainer(callbacks=[scheduler])
    assert facts.accumulation_schedule(trainer) == {0: 1, 2: 4}
    assert facts.several_micro_batches(trainer)  # accumulation from epoch 2 on


def test_no_scheduler_and_no_accumulation(namespace):
    trainer = namespace.trainer()
    assert facts.accumulation_schedule(trainer) is None
    assert not facts.several_micro_batches(trainer)


def _bare(cls: type) -> object:
    """An instance without ``__init__`` (DeepSpeed's needs the deepspeed package; the checks are type checks)."""
    return cls.__new__(cls)


@pytest.mark.parametrize("name", ["FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy"])
def test_sharded_strategies_are_named(namespace, name):
    cls = getattr(namespace.sub("strategies"), name)
    subclass = type(f"My{name}", (cls,), {})
    for strategy in (_bare(cls), _bare(subclass)):
        trainer = SimpleNamespace(strategy=strategy)
        assert facts.sharded_strategy(trainer) == name
        assert not facts.data_parallel_strategy(trainer)


@pytest.mark.parametrize("name", ["SingleDeviceStrategy", "DDPStrategy", "XLAStrategy"])
def test_data_parallel_strategies(namespace, name):
    trainer = SimpleNamespace(strategy=_bare(getattr(namespace.sub("strategies"), name)))
    assert facts.sharded_strategy(trainer) is None
    assert facts.data_parallel_strategy(trainer)


def test_a_real_ddp_trainer_is_data_parallel(namespace):
    trainer = namespace.trainer(strategy="ddp_spawn", devices=2)
    assert facts.data_parallel_strategy(trainer) and facts.sharded_strategy(trainer) is None


def test_a_custom_strategy_is_neither(namespace):
    custom = type("MyStrategy", (namespace.sub("strategies").ParallelStrategy,), {})
    custom.__abstractmethods__ = frozenset()  # a stand-in: only its type is checked
    trainer = SimpleNamespace(strategy=_bare(custom))
    assert facts.sharded_strategy(trainer) is None
    assert not facts.data_parallel_strategy(trainer)


def test_progress_bar_follows_the_trainer(namespace):
    assert not facts.progress_bar_enabled(namespace.trainer(enable_progress_bar=False))
    assert facts.progress_bar_enabled(namespace.trainer(enable_progress_bar=True))
