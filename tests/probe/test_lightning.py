"""The Lightning adapter leaves the user's run as it was: epoch-level torchmetrics values and lists filled in
``training_step`` are identical with and without a probe; a step that returns ``None`` or raises (not an OOM)
makes the probe step aside ("not measured") and the fit goes on."""

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

from tests.helpers import mlp, quiet_trainer
from tests.probe.models import ProbeAtBatch, RecordingLogger

EPOCHS, STEPS_PER_EPOCH = 3, 16


class MetricClassifier(pl.LightningModule):
    """Training accuracy through a torchmetrics metric logged per epoch, and a list and a counter filled in
    ``training_step``: the state a probe calling ``training_step`` directly used to leave changed."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.train_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.losses: list[float] = []
        self.steps = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        self.losses.append(loss.item())
        self.steps += 1
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


def fit(digits, module, callbacks=()):
    x, y = digits
    pl.seed_everything(0, verbose=False)
    loader = DataLoader(TensorDataset(x[:512], y[:512]), batch_size=32, shuffle=True)
    logger = RecordingLogger()
    trainer = quiet_trainer(max_epochs=EPOCHS, logger=logger, log_every_n_steps=1, callbacks=list(callbacks))
    trainer.fit(module, loader)
    epoch_acc = [m["train_acc"] for m in logger.metrics if "train_acc" in m]
    return trainer, epoch_acc


def probe_at(*batches, **kwargs):
    return ProbeAtBatch(at=batches, memory_budget_bytes=2_000_000, max_batch_size=256, timed_steps=2, **kwargs)


def test_the_setup_trains_without_a_probe(digits):
    trainer, epoch_acc = fit(digits, module := MetricClassifier())
    assert len(epoch_acc) == EPOCHS and epoch_acc[0] < epoch_acc[-1] and epoch_acc[-1] > 0.8
    assert module.steps == len(module.losses) == EPOCHS * STEPS_PER_EPOCH == trainer.global_step


def test_epoch_metrics_and_user_lists_are_identical_with_and_without_the_probe(digits):
    _, plain_acc = fit(digits, plain := MetricClassifier())
    probe = probe_at(0, 5)  # at the first batch, and mid-epoch with metric state and list entries present
    _, probed_acc = fit(digits, probed := MetricClassifier(), [probe])

    assert probe.results[0].measured and probe.results[5].max_micro_batch > 32
    assert len(probe.results[5].trials) > 5  # the probe ran training_step many times
    assert probed_acc == plain_acc  # exactly: the probe's steps left no trace in the metric
    assert probed.losses == plain.losses and probed.steps == plain.steps == EPOCHS * STEPS_PER_EPOCH
    assert probe.results[5].not_restored == []


class SkipsFirstBatch(MetricClassifier):
    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            return None  # Lightning skips the step
        return super().training_step(batch, batch_idx)


def test_a_step_returning_none_makes_the_probe_step_aside_and_the_fit_completes(digits):
    probe = probe_at(0)
    with pytest.warns(RuntimeWarning, match="stepped aside.*returned None"):
        trainer, epoch_acc = fit(digits, module := SkipsFirstBatch(), [probe])
    result = probe.results[0]
    assert not result.measured and result.max_micro_batch is None and "returned None" in result.error
    assert result.throughput == {} and "not measured" in result.summary()
    assert trainer.current_epoch == EPOCHS and len(epoch_acc) == EPOCHS  # the fit ran to its end
    assert module.steps == EPOCHS * (STEPS_PER_EPOCH - 1)  # every batch but the skipped ones trained


class FailsAtOtherSizes(MetricClassifier):
    def training_step(self, batch, batch_idx):
        if batch[0].shape[0] != 32:
            raise ValueError("a shape this model never expected")
        return super().training_step(batch, batch_idx)


def test_a_non_oom_error_restores_the_state_warns_and_training_goes_on(digits):
    plain_trainer, plain_acc = fit(digits, plain := MetricClassifier())
    probe = probe_at(3)
    with pytest.warns(RuntimeWarning, match="stepped aside.*ValueError: a shape"):
        trainer, epoch_acc = fit(digits, failing := FailsAtOtherSizes(), [probe])
    assert not probe.results[3].measured
    assert trainer.global_step == plain_trainer.global_step and epoch_acc == plain_acc
    assert failing.losses == plain.losses
    for a, b in zip(failing.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_the_not_measured_result_round_trips_and_reads_as_no_probe():
    from gns_callback.probe import ProbeResult
    from gns_callback.recommendation.sizing import probe_inputs

    result = ProbeResult.not_measured("TypeError: no loss", device="cpu", headroom=0.85)
    assert ProbeResult.from_dict(result.to_dict()) == result
    assert probe_inputs(result) == (None, {}) and probe_inputs(result.to_dict()) == (None, {})
