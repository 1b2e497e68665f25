"""A training_step that raises a real-looking CUDA OOM above a threshold: the probe lands at or below it, on a
size it really ran, and training then proceeds."""

import pytest
import torch

from gns_callback.probe import probe_micro_batch
from tests.helpers import mlp, quiet_trainer
from tests.probe.models import ProbeAtBatch, ThresholdClassifier, digits_loader


def test_probe_at_the_first_batch_stays_below_the_oom_threshold_and_training_proceeds(digits):
    x, y = digits
    module = ThresholdClassifier(mlp(), thresholds=[37], lr=0.1)
    probe = ProbeAtBatch(at=(0,), timed_steps=2)  # no budget: this machine's memory; the OOM is the limit
    trainer = quiet_trainer(max_steps=5, callbacks=[probe])
    trainer.fit(module, digits_loader(x[:64], y[:64]))

    result = probe.results[0]
    assert result.max_micro_batch <= 37
    assert result.max_micro_batch >= 35  # bisection to within max(1, 5%) of the threshold
    assert any(t.size == result.max_micro_batch and t.ok for t in result.trials)
    failed = [t for t in result.trials if not t.ok]
    assert failed and all(t.size > 37 and "CUDA out of memory" in t.error for t in failed)
    assert all(t.ok for t in result.trials if t.size <= 37)
    assert trainer.global_step == 5
    assert module.sizes_seen[-5:] == [8] * 5  # the real steps after the probe ran on the real batches


def test_plain_function_on_a_lightning_module_without_a_trainer(digits):
    """Default step: ``training_step`` (its ``self.log`` is silenced: without a Trainer it would raise)."""
    x, y = digits
    module = ThresholdClassifier(mlp(), thresholds=[100])
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    result = probe_micro_batch(module, opt, (x[:8], y[:8]), throughput_sizes=[16], timing_budget_s=0.1,
                               progress_bar=False)
    assert 96 <= result.max_micro_batch <= 100
    assert any(t.size == result.max_micro_batch and t.ok for t in result.trials)
    assert "log" not in module.__dict__ and "log_dict" not in module.__dict__  # patches removed


def test_typed_out_of_memory_error_is_caught_too(digits):
    x, y = digits
    net = mlp()

    def step(batch):
        if batch[0].shape[0] > 20:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return torch.nn.functional.cross_entropy(net(batch[0]), batch[1])

    result = probe_micro_batch(net, None, (x[:8], y[:8]), step, throughput=False, progress_bar=False)
    assert result.max_micro_batch == 20


class BuggyClassifier(ThresholdClassifier):
    calls: list = []  # on the class: the probe puts the instance's attributes (sizes_seen) back

    def training_step(self, batch):  # no batch_idx: Lightning allows it, and so does the probe
        BuggyClassifier.calls.append(batch[0].shape[0])
        if batch[0].shape[0] >= 8:
            raise ValueError("a bug, not a memory problem")
        return super().training_step(batch, 0)


def test_a_non_oom_error_propagates(digits):
    x, y = digits
    module = BuggyClassifier(mlp(), thresholds=[10**9])
    with pytest.raises(ValueError, match="a bug"):
        probe_micro_batch(module, None, (x[:8], y[:8]), progress_bar=False)
    assert BuggyClassifier.calls == [2, 8]  # the trial at 2 ran, the one at 8 raised
    assert module.sizes_seen == []  # and the list the steps filled is as it was
