"""What the callback refuses at fit start, in the namespace of the Trainer, and what it says works instead.

FSDP and model parallel are refused in real fits: Lightning refuses FSDP on CPU by exact type
(``type(strategy) is FSDPStrategy``), so a subclass gets through to the callback's ``setup("fit")``, which runs
after the process group starts and before the strategy wraps the model. DeepSpeed's strategy cannot be built
without the deepspeed package, so a bare instance stands in for it on a real Trainer. A model under torch.compile
(a compiled submodule, or the LightningModule handed to ``fit`` compiled) with one micro-batch per step is refused:
the per-example hooks can't see a compiled forward (gns_callback/per_example/compiled.py). A copy of the model made
during the fit (an ``AveragedModel``) is measured beside, and left without hooks.
"""

from __future__ import annotations

import gc
import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.optim.swa_utils import AveragedModel

from gns_callback import GradientNoiseScaleCallback
from gns_callback.lightning import supported
from tests.helpers import module_hooks, package_objects_reachable
from tests.lightning.modules import digits_classifier, digits_net


def quiet(**kwargs) -> GradientNoiseScaleCallback:
    return GradientNoiseScaleCallback(verbose=False, **kwargs)


@pytest.fixture
def single_process_group():
    """Lightning starts a one-process gloo group for these strategies and leaves it (and its environment
    variables) behind after an error in a hook: both are put back."""
    environment = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


def assert_says_what_works(message: str) -> None:
    assert "strategy='ddp'" in message and "GradientNoiseScaleMeter" in message


@pytest.mark.parametrize("name", ["FSDPStrategy", "ModelParallelStrategy"])
def test_sharded_strategy_is_refused_at_fit_start(namespace, name, single_process_group):
    cls = getattr(namespace.sub("strategies"), name)
    strategy = type(f"CPU{name}", (cls,), {})()
    trainer = namespace.trainer(strategy=strategy, max_steps=2, callbacks=[quiet()])
    module = namespace.classifier(lr=0.1)
    with pytest.raises(namespace.MisconfigurationException, match=f"cannot measure under CPU{name} \\(a {name}\\)") as err:
        trainer.fit(module)
    assert_says_what_works(str(err.value))
    assert trainer.global_step == 0


def test_deepspeed_is_refused(namespace, monkeypatch):
    cls = namespace.sub("strategies").DeepSpeedStrategy
    trainer, module = namespace.trainer(), namespace.classifier()
    monkeypatch.setattr(trainer._accelerator_connector, "strategy", cls.__new__(cls))
    with pytest.raises(namespace.MisconfigurationException, match="cannot measure under DeepSpeedStrategy") as err:
        quiet().setup(trainer, module, "fit")
    assert_says_what_works(str(err.value))


def test_a_custom_strategy_is_measured_with_a_warning(namespace, monkeypatch):
    custom = type("MyStrategy", (namespace.sub("strategies").Strategy,), {"is_global_zero": True})
    custom.__abstractmethods__ = frozenset()  # a stand-in: only its type is checked
    trainer, module = namespace.trainer(), namespace.classifier()
    monkeypatch.setattr(trainer._accelerator_connector, "strategy", custom.__new__(custom))
    with pytest.warns(UserWarning, match="has not been checked with MyStrategy") as record:
        quiet().setup(trainer, module, "fit")
    assert_says_what_works(str(record[0].message))


def test_ddp_and_single_device_are_measured_silently(namespace, recwarn):
    for trainer in (namespace.trainer(), namespace.trainer(strategy="ddp_spawn", devices=2)):
        assert supported.refusal(trainer, namespace.classifier(), adapt=False) is None
        assert supported.unverified_strategy_warning(trainer) is None


def test_adapt_beside_either_namespace_scheduler_is_refused(namespace):
    scheduler = namespace.sub("callbacks").GradientAccumulationScheduler({0: 2})
    trainer = namespace.trainer(callbacks=[quiet(adapt=True), scheduler])
    with pytest.raises(namespace.MisconfigurationException, match="adapt=True.*GradientAccumulationScheduler"):
        trainer.fit(namespace.classifier(micro_batches=4))


def test_manual_optimization_is_refused(namespace):
    module = namespace.classifier()
    module.automatic_optimization = False
    with pytest.raises(namespace.MisconfigurationException, match="automatic optimization"):
        namespace.trainer(callbacks=[quiet()]).fit(module)


def test_batch_norm_with_either_namespace_scheduler_is_measured_by_micro_batches(namespace):
    """BatchNorm rules out per-example norms; the scheduler's accumulation makes micro-batches possible."""
    scheduler = namespace.sub("callbacks").GradientAccumulationScheduler({0: 2})
    cb = quiet()
    trainer = namespace.trainer(callbacks=[cb, scheduler])
    trainer.fit(namespace.classifier(batch_norm=True, lr=0.05, micro_batches=40))
    assert cb.resolved_method == "micro_batch"
    assert cb.run_estimate.steps == trainer.global_step == 20  # 40 micro-batches, 2 per step: every step measured


def test_batch_norm_without_accumulation_is_refused_in_the_namespace(namespace):
    with pytest.raises(namespace.MisconfigurationException, match="BatchNorm.*accumulate_grad_batches=2"):
        namespace.trainer(callbacks=[quiet()]).fit(namespace.classifier(batch_norm=True, micro_batches=4))


@pytest.mark.parametrize("how", ["submodule", "whole module"])
def test_a_compiled_model_without_micro_batches_is_refused_at_fit_start(namespace, how, fresh_compiler):
    module = namespace.classifier(lr=0.1)
    if how == "submodule":
        module.net = torch.compile(module.net, backend="aot_eager")
    else:
        module = torch.compile(module, backend="aot_eager")  # Lightning compiles training_step itself
    trainer = namespace.trainer(max_steps=3, callbacks=[quiet()])
    with pytest.raises(namespace.MisconfigurationException,
                       match="compiled with torch.compile.*set accumulate_grad_batches=2 or more") as error:
        trainer.fit(module)
    assert "method='micro_batch' measures a compiled model" in str(error.value)
    assert trainer.global_step == 0


def _loaders_module(namespace, combine: str):
    """The digits classifier trained from the loaders ``combine`` names: each batch's loss is the mean over every
    example of every loader in it."""
    base = type(namespace.classifier())

    class Loaders(base):
        def training_step(self, batch, batch_idx):
            parts = batch.values() if isinstance(batch, dict) else [batch]
            x, y = (torch.cat(t) for t in zip(*parts))
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def train_dataloader(self):
            loaders = {name: super(Loaders, self).train_dataloader() for name in ("a", "b")}
            if combine == "one loader in a dict":
                return {"a": loaders["a"]}
            if combine == "min_size":
                return namespace.sub("utilities").CombinedLoader(loaders, mode="min_size")
            return loaders  # Lightning combines a dict of loaders in mode 'max_size_cycle'

    return Loaders(lr=0.1, micro_batches=8)


def test_batches_combined_from_several_loaders_are_refused_at_the_first_batch(namespace):
    """Rows of two loaders share an index: per-example norms would add two examples as one (B_simple read half
    the exact value before this refusal); nothing has trained when it is raised."""
    trainer = namespace.trainer(max_steps=4, callbacks=[quiet()])
    module = _loaders_module(namespace, "dict")
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(namespace.MisconfigurationException,
                       match="combined from 2 training DataLoaders \\(mode 'max_size_cycle'\\)") as error:
        trainer.fit(module)
    assert "ConcatDataset" in str(error.value) and "GradientNoiseScaleMeter" in str(error.value)
    assert trainer.global_step == 0
    assert all(torch.equal(p, b) for p, b in zip(module.parameters(), before))


def test_a_combined_loader_in_another_mode_is_refused_too(namespace):
    trainer = namespace.trainer(max_steps=4, callbacks=[quiet()])
    with pytest.raises(namespace.MisconfigurationException, match="2 training DataLoaders \\(mode 'min_size'\\)"):
        trainer.fit(_loaders_module(namespace, "min_size"))
    assert trainer.global_step == 0


def test_one_loader_in_a_dict_is_measured(namespace):
    cb = quiet()
    trainer = namespace.trainer(max_steps=6, callbacks=[cb])
    trainer.fit(_loaders_module(namespace, "one loader in a dict"))
    assert trainer.global_step == 6 and cb.run_estimate.steps == 6


def test_an_averaged_copy_made_at_fit_start_is_left_without_hooks(namespace):
    """``self.average = AveragedModel(self.net)`` in ``on_fit_start``, after the callback put its hooks on: the fit
    is measured as without the copy, and after it the copy holds no hook, no object of the callback, and no hidden
    copy of the LightningModule, and pickles without gns_callback. Before, the copy's forward hooks were bound to a
    copy of the tracker, whose ``.model`` was a copy of the whole LightningModule: the copy kept them after the fit
    (its forward and backward about 1.5x slower) and held that LightningModule copy in memory."""

    class Averaged(digits_classifier(namespace.name)):
        def on_fit_start(self):
            self.average = AveragedModel(self.net)

        def on_train_batch_end(self, *args):
            self.average.update_parameters(self.net)

    estimates = []
    for module in (namespace.classifier(lr=0.1, micro_batches=8), Averaged(lr=0.1, micro_batches=8)):
        callback = quiet()
        namespace.trainer(callbacks=[callback]).fit(module)
        estimates.append(callback.run_estimate)
    assert estimates[1].steps > 0 and estimates[1] == estimates[0]
    assert module_hooks(module.average) == [] and package_objects_reachable(module.average) == []
    assert b"gns_callback" not in pickle.dumps(module.average)
    gc.collect()
    assert [obj for obj in gc.get_objects() if type(obj) is Averaged] == [module]


@pytest.mark.parametrize("rows, batch_size, drawn, stops", [
    (16, 16, 1797, False),
    (8, 16, 1797, True),  # a sequence-first batch of 16 sequences of 8
    (64, 16, 1797, True),  # 4 rows per example (crops)
    (10, 16, 10, False),  # a sampler of 10: the first batch is short
    (10, 16, None, False),  # a sampler of no length: it may be
    (8, None, 1797, False),  # a batch_sampler: no batch_size to compare
    (8, 1, 1797, False),  # batch_size=1 over a data set of ready-made batches
])
def test_rows_not_examples_compares_the_first_batch_with_the_loader(rows, batch_size, drawn, stops):
    from types import SimpleNamespace

    class Sampler:
        def __len__(self):
            if drawn is None:
                raise TypeError("no length")
            return drawn

    trainer = SimpleNamespace(train_dataloader=SimpleNamespace(batch_size=batch_size, sampler=Sampler()))
    assert (supported.rows_not_examples(trainer, rows) is not None) == stops
