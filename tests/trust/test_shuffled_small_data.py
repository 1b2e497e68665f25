"""A ``DataLoader(shuffle=True)`` draws each epoch's batches without replacement, and on a small data set that
matters: ``|G|²`` read low by about ``tr Σ/N`` and ``B_simple`` high by ``B_simple/N`` (18% on wine's 178 examples,
where the uncorrected interval missed the exact value in 14 of 40 runs of 150 steps). The callback reads the
sampler and corrects for it (:mod:`gns_callback.sampling`); a loader that does not shuffle at all is said once."""

import json

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_wine
from torch import nn
from pytorch_lightning.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader, TensorDataset

from gns_callback import GradientNoiseScaleCallback, load_estimate
from tests.helpers import Classifier, assert_matches_exact, quiet_trainer
from tests.trust.setups import messages, single, with_and_without

EPOCHS = 55  # 605 steps of 16: an interval narrow enough that the uncorrected 18% shows


def wine():
    data = load_wine()
    x = torch.tensor(data.data, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), torch.tensor(data.target)


def net():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 32), nn.Tanh(), nn.Linear(32, 3))
    with torch.no_grad():
        model[2].weight.mul_(3.0)
    return model


def fit(tmp_path, shuffle):
    x, y = wine()
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    generator = torch.Generator().manual_seed(0)
    _, caught = with_and_without(
        lambda: Classifier(net()),
        lambda: DataLoader(TensorDataset(x, y), batch_size=16, shuffle=shuffle, drop_last=True, generator=generator),
        callback, max_epochs=EPOCHS)
    return callback, caught


def test_a_shuffled_epoch_of_wine_holds_the_exact_value(tmp_path, exact_gns):
    callback, caught = fit(tmp_path, shuffle=True)
    assert callback.meter.population == 178
    assert json.loads((tmp_path / "report.json").read_text())["run"]["drawn_without_replacement_from"] == 178
    assert_matches_exact(callback.run_estimate, exact_gns(net(), F.cross_entropy, *wine())[0], max_ci_ratio=1.6)
    assert not messages(caught, "does not shuffle")


def test_a_loader_that_does_not_shuffle_is_refused_before_the_first_step(tmp_path):
    """Its batches are the same every epoch: before this refusal, wine in its own order (by class) read B_simple =
    6.80 (95% CI 5.83-7.81) against the exact 32.8, with only a warning (``benchmarks/shuffled_epochs.py``)."""
    x, y = wine()
    module = Classifier(net())
    before = [p.detach().clone() for p in module.parameters()]
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    with pytest.raises(MisconfigurationException, match="does not shuffle") as refusal:
        quiet_trainer(max_epochs=1, callbacks=[callback]).fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    assert "shuffle=True" in str(refusal.value) and "data_in_random_order=True" in str(refusal.value)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))


def test_data_in_a_random_order_read_in_order_is_measured(tmp_path, exact_gns):
    """``data_in_random_order=True``: wine drawn at random beforehand (with replacement, one epoch of them) and read
    in order holds the exact value of wine itself."""
    x, y = wine()
    draws = torch.randint(0, len(x), (EPOCHS * 11 * 16,), generator=torch.Generator().manual_seed(0))
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False,
                                          data_in_random_order=True)
    quiet_trainer(max_epochs=1, callbacks=[callback]).fit(
        Classifier(net()), DataLoader(TensorDataset(x[draws], y[draws]), batch_size=16))
    assert callback.meter.population == len(draws)
    assert_matches_exact(callback.run_estimate, exact_gns(net(), F.cross_entropy, x, y)[0], max_ci_ratio=1.6)


def test_a_resumed_fit_corrects_for_the_shuffled_epoch_too(tmp_path):
    """The sampler is read at every fit's start, a resumed one included (before, only at a fresh fit's first batch:
    a resumed run left the correction out)."""
    x, y = wine()
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, drop_last=True)
    first = GradientNoiseScaleCallback(report_path=str(tmp_path / "first.json"), verbose=False)
    trainer = quiet_trainer(max_epochs=2, callbacks=[first])
    trainer.fit(Classifier(net()), loader)
    trainer.save_checkpoint(tmp_path / "two_epochs.ckpt")
    resumed = GradientNoiseScaleCallback(report_path=str(tmp_path / "resumed.json"), verbose=False)
    quiet_trainer(max_epochs=3, callbacks=[resumed]).fit(Classifier(net()), loader,
                                                         ckpt_path=str(tmp_path / "two_epochs.ckpt"))
    assert resumed.meter.population == 178
    assert resumed.run_estimate.steps == 33 and first.run_estimate.steps == 22


class ShuffledWine(Classifier):
    """Its own shuffled loader, built in each process: under DDP Lightning swaps in a DistributedSampler."""

    def train_dataloader(self):
        return DataLoader(TensorDataset(*wine()), batch_size=8, shuffle=True, drop_last=True)


@pytest.mark.usefixtures("file_system_sharing")
def test_ddp_shards_of_one_shuffled_order_are_corrected_for(tmp_path, exact_gns):
    """Two processes at the defaults (``use_distributed_sampler`` on): the ranks' shards of one shuffled order are
    one draw without replacement of 16 from the 178 examples. (Here the uncorrected interval would also hold the exact
    value; the single-process test above is the one that tells them apart.)"""
    report = tmp_path / "report.json"
    callback = GradientNoiseScaleCallback(report_path=str(report), verbose=False)
    quiet_trainer(strategy="ddp_spawn", devices=2, max_epochs=EPOCHS, callbacks=[callback]).fit(ShuffledWine(net()))
    data = json.loads(report.read_text())
    assert data["run"]["drawn_without_replacement_from"] == 178 and data["run"]["world_size"] == 2
    assert_matches_exact(load_estimate(str(report), "run_estimate"), exact_gns(net(), F.cross_entropy, *wine())[0],
                         max_ci_ratio=1.6)


class Curriculum(Classifier):
    """Trains on the first ``first`` examples in epoch 0, then on all of them (``reload_dataloaders_every_n_epochs=1``);
    ``shuffle_later=False``: the later epochs' loader reads them in order."""

    def __init__(self, net, data, first, shuffle_later=True):
        super().__init__(net, lr=0.0)
        self.data, self.first, self.shuffle_later = data, first, shuffle_later

    def train_dataloader(self):
        x, y = self.data
        n = self.first if self.current_epoch == 0 else len(x)
        return DataLoader(TensorDataset(x[:n], y[:n]), batch_size=32, drop_last=True,
                          shuffle=self.current_epoch == 0 or self.shuffle_later)


def curriculum_fit(digits, tmp_path, shuffle_later):
    from tests.helpers import mlp

    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    torch.manual_seed(0)
    _, caught = with_and_without(lambda: Curriculum(mlp(), digits, 96, shuffle_later), lambda: None, callback,
                                 max_epochs=4, reload_dataloaders_every_n_epochs=1)
    return callback, caught


def test_a_reloaded_loader_of_another_size_is_corrected_for_its_own_population(digits, tmp_path, exact_gns):
    """Epoch 0 draws from 96 examples, the next three from all 1,797. Before, the first loader's 96 stood for the
    whole run: 39.8 [36.8, 43.2] against an exact 67.0 on 1,400 examples of digits (an audit's curriculum)."""
    from tests.helpers import mlp

    callback, _ = curriculum_fit(digits, tmp_path, shuffle_later=True)
    assert callback.meter.population == len(digits[0])
    assert_matches_exact(callback.run_estimate, exact_gns(mlp(), F.cross_entropy, *digits)[0])


def test_a_reloaded_loader_that_does_not_shuffle_stops_the_measurement_and_the_run_goes_on(digits, tmp_path):
    callback, caught = curriculum_fit(digits, tmp_path, shuffle_later=False)
    assert "reloaded for epoch 1" in single(messages(caught, "stopped measuring"))
    assert not callback.run_estimate.measured and "shuffle=True" in callback.run_estimate.failure


def test_overfit_batches_is_refused_with_its_own_fix(tmp_path):
    """``overfit_batches`` replaces the user's shuffling sampler with one read in order. Before, the refusal said
    "Pass shuffle=True to the training DataLoader", which the DataLoader already had."""
    x, y = wine()
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    with pytest.raises(MisconfigurationException, match=r"overfit_batches=2.*overfit_batches=0") as refusal:
        quiet_trainer(max_epochs=1, overfit_batches=2, callbacks=[callback]).fit(Classifier(net()), loader)
    assert "shuffle=True" not in str(refusal.value)
