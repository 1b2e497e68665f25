"""Nothing about the run changes: weights, optimizer state, BatchNorm statistics, RNG, gradients, modes,
requires_grad, the step counter, the loggers, the data order, and no files are left behind."""

import copy
import os
import random
import tempfile

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from gns_callback.probe import preserved_state, probe_micro_batch
from tests.helpers import Classifier, bn_mlp, quiet_trainer
from tests.probe.models import ProbeAtBatch, RecordingLogger


def clone(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone(v) for v in value)
    return value


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def rng_states():
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
            "python": random.getstate()}


def snapshot(model, optimizers):
    params = list(model.parameters())
    return {
        "model": clone(model.state_dict()),  # parameters and buffers: running stats, num_batches_tracked
        "optimizers": [clone(opt.state_dict()) for opt in optimizers],
        "optimizer_state_sizes": [len(opt.state) for opt in optimizers],
        "grads": [None if p.grad is None else p.grad.clone() for p in params],
        "grad_ids": [id(p.grad) for p in params],
        "requires_grad": [p.requires_grad for p in params],
        "modes": [m.training for m in model.modules()],
        "rng": rng_states(),
        "opt_called": [getattr(opt, "_opt_called", "missing") for opt in optimizers],
    }


def dropout_bn_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, 10))


class LoggingClassifier(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        self.log_dict({"first_x": batch[0][0, 0]})
        return loss


class TrainerStateCheck:
    """Around each probe: everything in :func:`snapshot`, plus the Trainer's counters, metrics, logger, files."""

    def __init__(self, directories):
        self.directories = directories
        self.checked = 0

    def __call__(self, trainer, pl_module, before):
        now = {
            "snapshot": snapshot(pl_module, trainer.optimizers),
            "global_step": trainer.global_step,
            "batch_progress": trainer.fit_loop.epoch_loop.batch_progress.state_dict(),
            "callback_metrics": clone(dict(trainer.callback_metrics)),
            "logged": clone(trainer.logger.metrics),
            "files": {d: sorted(os.listdir(d)) for d in self.directories},
        }
        if before is None:
            return now
        assert_same(before, now)
        self.checked += 1


def fit(digits, callbacks=(), logger=None, steps=8):
    x, y = digits
    pl.seed_everything(3, verbose=False)
    module = LoggingClassifier(dropout_bn_net(), lr=1e-2, optimizer="adam")
    loader = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=16, shuffle=True)
    trainer = quiet_trainer(max_steps=steps, logger=logger, log_every_n_steps=1, callbacks=list(callbacks))
    trainer.fit(module, loader)
    return trainer, module


def test_training_with_probes_is_bit_identical_to_training_without(digits, tmp_path, monkeypatch):
    """Probes before Adam has any state (batch 0) and after a few steps (batch 3, state and gradients present)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    check = TrainerStateCheck([str(tmp_path), str(tmp_path / "tmp")])
    probe = ProbeAtBatch(at=(0, 3), check=check, memory_budget_bytes=400_000, timed_steps=2,
                         search_split=True, global_batch_size=64)
    probed_logger, plain_logger = RecordingLogger(), RecordingLogger()
    probed, probed_module = fit(digits, [probe], probed_logger)
    plain, plain_module = fit(digits, [], plain_logger)

    assert check.checked == 2 and probe.results[0].max_micro_batch > 16
    assert probed.global_step == plain.global_step == 8
    assert_same(clone(probed_module.state_dict()), clone(plain_module.state_dict()))
    assert_same(clone(probed.optimizers[0].state_dict()), clone(plain.optimizers[0].state_dict()))
    # the loggers saw the same values (the probe's self.log calls were dropped); same data order ("first_x")
    assert len(probed_logger.metrics) == 8
    assert_same([{k: v for k, v in m.items() if k != "epoch"} for m in probed_logger.metrics],
                [{k: v for k, v in m.items() if k != "epoch"} for m in plain_logger.metrics])
    assert_same(rng_states(), rng_states())
    assert sorted(os.listdir(tmp_path / "tmp")) == []


def test_plain_function_restores_everything_before_adam_has_state():
    net = bn_mlp()
    net[0].bias.requires_grad_(False)
    net.train()
    net[1].eval()  # a mixed-mode model: BatchNorm in eval, the rest training
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=0.1)
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    before = snapshot(net, [opt])
    result = probe_micro_batch(net, opt, batch, lambda b: F.cross_entropy(net(b[0]), b[1]),
                               memory_budget_bytes=200_000, timed_steps=2, timing_budget_s=0.1, progress_bar=False)
    assert result.max_micro_batch > 8
    assert len(opt.state) == 0  # no lazily created state left behind
    assert_same(before, snapshot(net, [opt]))
    assert all(p.grad is None for p in net.parameters())


def test_trials_are_training_steps_and_eval_mode_comes_back():
    net = bn_mlp().eval()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    modes = set()

    def step(b):
        modes.add((net.training, net[1].training))
        return F.cross_entropy(net(b[0]), b[1])

    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    before = snapshot(net, [opt])
    probe_micro_batch(net, opt, batch, step, memory_budget_bytes=200_000, timed_steps=2, timing_budget_s=0.1,
                      progress_bar=False)
    assert modes == {(True, True)}
    assert_same(before, snapshot(net, [opt]))
    assert not any(m.training for m in net.modules())


def test_plain_function_restores_adam_state_gradients_and_scheduler_flag():
    net = bn_mlp()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = lambda b: F.cross_entropy(net(b[0]), b[1])
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    for _ in range(3):
        opt.zero_grad()
        step(batch).backward()
        opt.step()
        scheduler.step()
    step(batch).backward()  # gradients present, not yet stepped
    before = snapshot(net, [opt])
    probe_micro_batch(net, opt, batch, step, memory_budget_bytes=200_000, timed_steps=2, timing_budget_s=0.1,
                      progress_bar=False)
    assert_same(before, snapshot(net, [opt]))
    assert all(int(s["step"]) == 3 for s in opt.state.values())
    assert scheduler.last_epoch == 3 and opt.param_groups[0]["lr"] == pytest.approx(0.1 / 8)


@pytest.mark.parametrize("error", [ValueError("not a memory problem"), KeyboardInterrupt()])
def test_errors_propagate_after_the_state_is_restored(error):
    net = bn_mlp()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))

    def step(b):
        out = F.cross_entropy(net(b[0]), b[1])
        if b[0].shape[0] >= 8:  # after a successful trial at 2 has stepped (and restored) once
            raise error
        return out

    before = snapshot(net, [opt])
    with pytest.raises(type(error)):
        probe_micro_batch(net, opt, batch, step, memory_budget_bytes=200_000, progress_bar=False)
    assert_same(before, snapshot(net, [opt]))
    assert len(opt.state) == 0


class ManualModule(Classifier):
    def __init__(self, net):
        super().__init__(net, lr=0.1, optimizer="adam")
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        opt.step()
        self.log("loss", loss)


def test_manual_optimization_does_not_count_probe_steps(digits):
    x, y = digits
    check_steps = []

    def check(trainer, pl_module, before):
        if before is None:
            return snapshot(pl_module, trainer.optimizers), trainer.global_step
        assert_same(before[0], snapshot(pl_module, trainer.optimizers))
        check_steps.append((before[1], trainer.global_step))

    probe = ProbeAtBatch(at=(2,), check=check, memory_budget_bytes=300_000, timed_steps=2)
    trainer = quiet_trainer(max_steps=4, callbacks=[probe])
    trainer.fit(ManualModule(bn_mlp()), DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8))
    assert check_steps == [(2, 2)] and trainer.global_step == 4
    assert probe.results[2].max_micro_batch > 8


class WithOutsideModules(nn.Module):
    """A model whose attributes hold modules outside its tree (an EMA teacher in a plain list, another in a dict
    inside a list) and plain tensors in a list: none a submodule, in the ``state_dict`` or the optimizer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = bn_mlp()
        self.teacher = [copy.deepcopy(self.net).requires_grad_(False)]
        self.averages = [{"ema": copy.deepcopy(self.net)}]
        self.ema_tensors = [p.detach().clone() for p in self.net.parameters()]

    def outside(self) -> list[nn.Module]:
        return [self.teacher[0], self.averages[0]["ema"]]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """A training step that updates everything outside the tree in place (BatchNorm statistics included)."""
        loss = F.cross_entropy(self.net(x), y)
        teacher, ema = self.outside()
        loss = loss + F.mse_loss(ema(x), teacher(x))  # both in training mode: their running statistics move
        loss.backward()
        teacher.eval()
        with torch.no_grad():
            for weight, average, shadow in zip(self.net.parameters(), teacher.parameters(), self.ema_tensors):
                average.mul_(0.5).add_(weight)
                shadow.mul_(0.5).add_(weight)


def test_modules_and_tensors_outside_the_module_tree_are_put_back_in_place():
    """Restored in place, as the model's own: values, the same tensor objects, ``.grad`` and training flags (they
    counted by the list's identity alone and kept what the probe steps did to them)."""
    model = WithOutsideModules()
    opt = torch.optim.SGD([*model.parameters(), *model.averages[0]["ema"].parameters()], lr=0.1)
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    before = [snapshot(module, [opt]) for module in model.outside()]
    tensors = [[*module.parameters(), *module.buffers()] for module in model.outside()]
    shadows = list(model.ema_tensors)
    shadow_values = [t.clone() for t in shadows]
    lists = (model.teacher, model.averages, model.averages[0], model.ema_tensors)
    with preserved_state(model, [opt]) as state:
        for _ in range(2):
            model.step(*batch)
            assert model.averages[0]["ema"][1].num_batches_tracked.item() == 1
            state.restore()  # between passes too, any number of times
    for module, saved, kept in zip(model.outside(), before, tensors):
        assert_same(saved, snapshot(module, [opt]))
        assert [*module.parameters(), *module.buffers()] == kept  # the same objects: optimizer references hold
    assert (model.teacher, model.averages, model.averages[0], model.ema_tensors) == lists
    assert all(a is b for a, b in zip(model.ema_tensors, shadows))
    assert_same(shadow_values, model.ema_tensors)
    assert not state.not_restored
