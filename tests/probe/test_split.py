"""Split-factor / accumulation search: the pure search over given measurements, and one measured run."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from gns_callback.probe import measure_micro_batch
from gns_callback.probe.lightning import SplitFactor
from gns_callback.probe.split import (
    SplitMeasurement,
    SplitResult,
    SplitSetting,
    accumulation_settings,
    choose_fastest,
    divisors,
    run_split_search,
    smallest_fitting_accumulation,
    split_settings,
)
from tests.helpers import quiet_trainer
from tests.probe.models import ProbeAtBatch


class FakeTrial:
    def __init__(self, ok, step_seconds=None, optimizer_seconds=None):
        self.ok, self.step_seconds, self.optimizer_seconds = ok, step_seconds, optimizer_seconds


def identity(values):
    return list(values)


# ---------------------------------------------------------------------------------------------- pure
def test_divisors():
    assert divisors(1) == [1] and divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(49) == [1, 7, 49]
    with pytest.raises(ValueError):
        divisors(0)


def test_accumulation_settings_keep_the_global_batch():
    settings = accumulation_settings(1024, devices=8, max_micro_batch=40)
    assert [s.micro_batch for s in settings] == [32, 16, 8, 4, 2, 1]
    assert all(s.micro_batch * s.accumulate * 8 == 1024 and s.split == 1 for s in settings)
    assert smallest_fitting_accumulation(1024, 8, 40) == 4
    assert smallest_fitting_accumulation(1024, 8, 0) is None
    with pytest.raises(ValueError):
        accumulation_settings(1000, devices=3)


def test_split_settings_keep_accumulate_times_split_and_the_joint_batch():
    settings = split_settings(1024, devices=8, product=8)  # per device 128
    assert [(s.micro_batch, s.accumulate, s.split) for s in settings] == [
        (16, 8, 1), (32, 4, 2), (64, 2, 4), (128, 1, 8)]
    for s in settings:
        assert s.micro_batch * s.accumulate * 8 == 1024 and s.accumulate * s.split == 8
        assert s.joint_batch == 16 and s.micro_batch % s.split == 0
    # split must divide the micro-batch: 12 per device, product 4 → (3,4,1), (6,2,2), (12,1,4)
    assert [(s.micro_batch, s.split) for s in split_settings(24, 2, 4)] == [(3, 1), (6, 2), (12, 4)]


def test_choose_fastest_uses_accumulation_aware_throughput_and_ignores_what_does_not_fit():
    m = [
        SplitMeasurement(SplitSetting(16, 8, 1), True, 0.010, 0.005),  # 128 / 0.085
        SplitMeasurement(SplitSetting(32, 4, 2), True, 0.016, 0.005),  # 128 / 0.069 (fastest that fits)
        SplitMeasurement(SplitSetting(64, 2, 4), False),  # did not fit
        SplitMeasurement(SplitSetting(128, 1, 8), False, 0.001, 0.001),  # times without a fit don't count
    ]
    best = choose_fastest(m, devices=8)
    assert best.setting == SplitSetting(32, 4, 2)
    assert best.samples_per_s(8) == pytest.approx(8 * 128 / (4 * 0.016 + 0.005))
    assert choose_fastest([SplitMeasurement(SplitSetting(8, 1, 1), False)]) is None
    # ties: fewer accumulation steps
    tie = [SplitMeasurement(SplitSetting(8, 2, 1), True, 0.5, 0.0), SplitMeasurement(SplitSetting(16, 1, 1), True, 1.0, 0.0)]
    assert choose_fastest(tie).setting == SplitSetting(16, 1, 1)


def simulated(encoder_limit, joint_limit, split_overhead=0.002):
    """Memory: the encoder sees ``micro``, the joint ``micro/split``; time: per-sample work + per-chunk cost."""
    calls = []

    def measure(micro, split):
        calls.append((micro, split))
        s = split or 1
        ok = micro <= encoder_limit and micro // s <= joint_limit
        return FakeTrial(ok, 0.001 + 1e-4 * micro + split_overhead * s, 0.003) if ok else FakeTrial(False)

    return measure, calls


@pytest.mark.parametrize("encoder_limit, joint_limit", [(512, 16), (64, 16), (1024, 8), (40, 30)])
def test_seed_recipe_finds_the_brute_force_optimum(encoder_limit, joint_limit):
    global_batch, devices = 1024, 4
    measure, calls = simulated(encoder_limit, joint_limit)
    max_at_split_1 = min(encoder_limit, joint_limit)
    result = run_split_search(measure, identity, global_batch=global_batch, devices=devices,
                              max_micro_batch=max_at_split_1, current_split=1)
    # brute force over every (micro, accumulate, split) that keeps the global batch and the base product
    base = smallest_fitting_accumulation(global_batch, devices, max_at_split_1)
    candidates = split_settings(global_batch, devices, base) + split_settings(global_batch, devices, 2 * base)
    fresh, _ = simulated(encoder_limit, joint_limit)
    outcomes = [(s, fresh(s.micro_batch, s.split)) for s in candidates]
    brute = choose_fastest([SplitMeasurement(s, t.ok, t.step_seconds, t.optimizer_seconds) for s, t in outcomes], devices)
    assert result.best == brute.setting
    b = result.best
    assert b.micro_batch * b.accumulate * devices == global_batch
    assert b.accumulate * b.split in (base, 2 * base)
    # the seed stops at the first split that runs out of memory: at most one failure per product is tried
    for product in (base, 2 * base):
        failures = [m for m in result.measurements if m.setting.accumulate * m.setting.split == product and not m.ok]
        assert len([c for c in calls if c in {(f.setting.micro_batch, f.setting.split) for f in failures}]) <= 1


def test_special_case_doubles_accumulation_once_when_no_split_fits():
    # the encoder cannot take more than the base micro-batch: every split > 1 OOMs at product K → retry at 2K
    measure, calls = simulated(encoder_limit=32, joint_limit=32)
    result = run_split_search(measure, identity, global_batch=256, devices=1, max_micro_batch=32, current_split=1)
    products = {m.setting.accumulate * m.setting.split for m in result.measurements}
    assert products == {8, 16}
    assert result.best.micro_batch <= 32
    assert any(m.ok and m.setting.split == 2 for m in result.measurements)  # (32, 8, 2) at product 16


def test_without_a_split_factor_only_accumulation_is_traded():
    measure, calls = simulated(encoder_limit=100, joint_limit=100)
    result = run_split_search(measure, identity, global_batch=512, devices=2, max_micro_batch=100, current_split=None)
    assert not result.uses_split_factor
    assert [c for c in calls] == [(64, None), (32, None), (16, None), (8, None)]  # 4 largest that fit
    assert result.best in [s for s in accumulation_settings(512, 2, 100)]


def test_split_result_round_trips():
    measure, _ = simulated(512, 16)
    result = run_split_search(measure, identity, global_batch=1024, devices=4, max_micro_batch=16, current_split=1)
    assert SplitResult.from_dict(result.to_dict()) == result


def test_split_factor_is_found_as_attribute_class_attribute_or_hparam():
    class Plain(pl.LightningModule):
        pass

    class ClassLevel(pl.LightningModule):
        batch_split_factor = 2

    class ReadOnly(pl.LightningModule):
        def __init__(self, batch_split_factor=4):
            super().__init__()
            self.save_hyperparameters()

        @property
        def batch_split_factor(self):
            return self.hparams.batch_split_factor

    assert SplitFactor.find(Plain()) is None
    module = ClassLevel()
    handle = SplitFactor.find(module)
    with handle.applied(8):
        assert module.batch_split_factor == 8
    assert module.batch_split_factor == 2 and "batch_split_factor" not in vars(module)
    module = ReadOnly()
    handle = SplitFactor.find(module)
    assert handle.in_hparams and handle.get() == 4
    with handle.applied(1):
        assert module.batch_split_factor == 1
    assert module.batch_split_factor == 4


# ---------------------------------------------------------------------------------------------- measured
class JointModel(pl.LightningModule):
    """An encoder over the micro-batch, and a memory-hungry "joint" part computed in ``batch_split_factor``
    chunks, each with its own backward (the RNN-T pattern), so only one chunk's activations live at a time."""

    def __init__(self, batch_split_factor: int = 1, in_hparams: bool = False) -> None:
        super().__init__()
        if in_hparams:
            self.save_hyperparameters()
        else:
            self.batch_split_factor = batch_split_factor
        torch.manual_seed(0)
        self.encoder = nn.Linear(64, 16)
        self.expand = nn.Parameter(torch.randn(64))
        self.head = nn.Linear(16, 10)

    @property
    def split(self) -> int:
        return self.hparams["batch_split_factor"] if "batch_split_factor" in self.hparams else self.batch_split_factor

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.encoder(x))
        h_free = h.detach().requires_grad_()
        for index in torch.arange(x.shape[0]).chunk(self.split):
            z = torch.tanh(h_free[index][:, :, None] * self.expand)  # (chunk, 16, 64): the big part
            loss = F.cross_entropy(self.head(z.mean(-1)), y[index], reduction="sum") / x.shape[0]
            loss.backward()  # frees this chunk's activations
        return (h * h_free.grad).sum()  # backward through the encoder

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("in_hparams", [False, True])
def test_measured_split_search_on_a_module_with_batch_split_factor(digits, in_hparams):
    x, y = digits
    module = JointModel(in_hparams=in_hparams)
    assert SplitFactor.find(module).in_hparams == in_hparams
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    # a budget where 40 samples fit with split 1
    budget = int(measure_micro_batch(module, opt, (x[:8], y[:8]), [40])[0] / 0.85) + 1

    probe = ProbeAtBatch(at=(0,), memory_budget_bytes=budget, headroom=0.85, timed_steps=2, search_split=True,
                         global_batch_size=256)
    trainer = quiet_trainer(max_steps=1, callbacks=[probe])
    trainer.fit(module, DataLoader(TensorDataset(x[:64], y[:64]), batch_size=8))
    result = probe.results[0]
    split = result.split

    assert result.max_micro_batch == 40 and split.uses_split_factor
    assert module.split == 1  # restored
    # base: fewest accumulation steps at split 1 → micro 32 × accumulate 8; then trade accumulate for split
    assert {m.setting.accumulate * m.setting.split for m in split.measurements} >= {8}
    assert split.best is not None and split.best.micro_batch * split.best.accumulate == 256
    assert any(m.ok and m.setting.split > 1 for m in split.measurements)  # larger micro-batches through splitting
    # every verdict agrees with the accounting at that (micro, split)
    handle = SplitFactor.find(module)
    for m in split.measurements:
        handle.set(m.setting.split)
        measured = measure_micro_batch(module, opt, (x[:8], y[:8]), [m.setting.micro_batch])[0]
        assert m.ok == (measured <= 0.85 * budget), (m, measured)
    split_trials = [t for t in result.trials if t.phase == "split"]
    assert {(t.size, t.split) for t in split_trials} == {(m.setting.micro_batch, m.setting.split) for m in split.measurements}
