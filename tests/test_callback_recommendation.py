"""Probe and recommendation inside the callback, and adapt=True, on the digits data."""

import pytest
import torch

from gns_callback import GradientNoiseScaleCallback, read_report
from tests.helpers import Classifier, mlp, quiet_trainer, with_replacement_loader


def shuffled_loader(digits, batch_size=8, seed=0):
    x, y = digits
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:1504], y[:1504]), batch_size=batch_size,
                                       shuffle=True, generator=generator)


def test_recommendation_agrees_across_logs_summary_report_and_attribute(digits, tmp_path, monkeypatch):
    cb = GradientNoiseScaleCallback(report_path=str(tmp_path / "r.json"), log_every_n_steps=20)
    module = Classifier(mlp(), lr=0.05)
    printed = []
    monkeypatch.setattr("gns_callback.lightning.trainer_facts.say", lambda trainer, message: printed.append(message))
    trainer = quiet_trainer(max_epochs=2, callbacks=[cb], log_every_n_steps=20)
    trainer.fit(module, with_replacement_loader(*digits, batch_size=8, num_samples=8 * 200, seed=0))
    rec = cb.recommendation
    assert rec is not None and rec.learning_rate is not None
    assert rec.micro_batch_size * rec.accumulate_grad_batches * rec.num_devices == rec.batch_size
    assert rec.lr_rule == "noise_linear"  # SGD
    # Logged at the last logging point (step 400 = the last step): the same recommendation.
    metrics = trainer.callback_metrics
    assert metrics["gns/recommended_batch_size"].item() == rec.batch_size
    assert metrics["gns/recommended_lr"].item() == pytest.approx(rec.learning_rate, rel=1e-6)
    assert metrics["gns/recommended_accumulate_grad_batches"].item() == rec.accumulate_grad_batches
    # The JSON report's section, and the printed summary table.
    report = read_report(tmp_path / "r.json")
    assert report["recommendation"]["batch_size"] == rec.batch_size
    assert report["recommendation"]["learning_rate"] == pytest.approx(rec.learning_rate)
    assert rec.summary_table() in printed  # the rank-zero summary at fit end
    # The SGD LR transfer gets the run's early-phase noise scale, read off the same blocks as the batch target.
    early = report["critical_batch"]["early_noise_scale"]
    assert early is not None and early > 0 and report["batch_target"]["lr_noise_scale"] == pytest.approx(early)
    low = report["critical_batch"]["early_noise_scale_low"]
    assert low is not None and 0 <= low < early and report["batch_target"]["lr_noise_scale_low"] == pytest.approx(low)
    if rec.batch_size != rec.current.batch_size:
        assert any("B_noise" in note for note in rec.notes)


def test_probe_runs_once_reports_and_leaves_training_unchanged(digits, tmp_path):
    """Adam with lr > 0: identical weights with and without the probe; the probe is in the report."""
    weights = []
    for probe in (False, True):
        torch.manual_seed(0)
        cb = GradientNoiseScaleCallback(probe=probe, memory_budget_bytes=2_000_000, report_path=str(tmp_path / f"{probe}.json"))
        module = Classifier(mlp(), lr=1e-2, optimizer="adam")
        quiet_trainer(max_epochs=1, callbacks=[cb]).fit(module, shuffled_loader(digits, batch_size=16))
        weights.append({k: v.clone() for k, v in module.state_dict().items()})
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key
    assert cb.probe is not None and cb.probe.max_micro_batch > 0
    assert cb.probe.budget_bytes == 2_000_000
    report = read_report(tmp_path / "True.json")
    assert report["probe"]["max_micro_batch"] == cb.probe.max_micro_batch
    # The recommendation's micro-batch respects the probe.
    assert cb.recommendation.micro_batch_size <= cb.probe.max_micro_batch


def test_adapt_changes_accumulation_and_lr_at_an_epoch_boundary(digits, tmp_path):
    """B_simple ≈ 50–100 on this model while the batch is 8: once the interval is trusted, adapt raises the
    accumulation at an epoch start and scales the LR by the rule within the measured stability limit."""
    cb = GradientNoiseScaleCallback(adapt=True, adapt_patience=1, report_path=str(tmp_path / "r.json"))
    module = Classifier(mlp(), lr=0.01)
    trainer = quiet_trainer(max_epochs=6, callbacks=[cb])
    trainer.fit(module, shuffled_loader(digits))  # 188 micro-batches per epoch
    assert cb.adaptations, "no adaptation happened"
    first = cb.adaptations[0]
    assert first["epoch"] >= 1 and first["global_step"] == 188 * first["epoch"]  # at an epoch boundary
    old, new = first["accumulate_grad_batches"]
    # SGD: the noise-aware rule's increase, capped at the stability limit 2(1+β)/λ_max that the sharpness monitor
    # measured (never above the rule, never below the current LR), ramped in over a warmup.
    assert first["lr_rule"] == "noise_linear" and cb.sharpness_monitor.largest is not None
    limit = 2.0 / cb.sharpness_monitor.largest  # plain SGD, β = 0
    rule = (1 + first["b_simple"] / 8) / (1 + first["b_simple"] / first["batch_size"])
    assert old == 1 and new > 1
    assert 1.0 <= first["lr_factor"] <= rule * (1 + 1e-9)
    assert 0.01 * first["lr_factor"] <= max(limit, 0.01) * (1 + 1e-9)
    assert (first["warmup_steps"] > 0) == (first["lr_factor"] > 1.0)
    last = cb.adaptations[-1]
    assert trainer.accumulate_grad_batches == last["accumulate_grad_batches"][1]
    # The LR ends at the product of the factors once the last ramp is done (or is on its way there).
    total = 1.0
    for event in cb.adaptations:
        total *= event["lr_factor"]
    lr = module.optimizers().param_groups[0]["lr"]
    if cb._adapter.ramp is None:
        assert lr == pytest.approx(0.01 * total)
    else:
        assert 0.01 * total / last["lr_factor"] <= lr <= 0.01 * total
    assert trainer.current_epoch == 6  # training went on after the change
    assert read_report(tmp_path / "r.json")["adaptations"] == cb.adaptations


def test_adapt_resumes_from_a_checkpoint_with_the_adapted_settings(digits, tmp_path):
    cb = GradientNoiseScaleCallback(adapt=True, adapt_patience=1, verbose=False)
    module = Classifier(mlp(), lr=0.01)
    trainer = quiet_trainer(max_epochs=3, callbacks=[cb])
    trainer.fit(module, shuffled_loader(digits))
    assert cb.adaptations
    path = tmp_path / "adapt.ckpt"
    trainer.save_checkpoint(path)
    new = cb.adaptations[0]["accumulate_grad_batches"][1]
    lr = module.optimizers().param_groups[0]["lr"]

    resumed = GradientNoiseScaleCallback(adapt=True, adapt_patience=1, verbose=False)
    module2 = Classifier(mlp(), lr=0.01)
    trainer2 = quiet_trainer(max_epochs=4, callbacks=[resumed])
    trainer2.fit(module2, shuffled_loader(digits), ckpt_path=path)
    assert resumed.adaptations[0] == cb.adaptations[0]
    assert trainer2.accumulate_grad_batches >= new  # kept (or raised further), never reset to 1
    assert module2.optimizers().param_groups[0]["lr"] >= lr
    assert trainer2.global_step > trainer.global_step


@pytest.mark.parametrize("kwargs, match", [({"headroom": 0}, "headroom"), ({"lr_rule": "cubic"}, "lr_rule"),
                                           ({"adapt": True, "recommend": False}, "recommend"),
                                           ({"memory_budget_bytes": -1}, "memory_budget_bytes")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientNoiseScaleCallback(**kwargs)


def test_report_says_how_far_the_critical_batch_is_calibrated_for_the_optimizer(digits, tmp_path):
    for optimizer, words in (("sgd", "plain SGD: the calibrated case"), ("adam", "lower bound")):
        cb = GradientNoiseScaleCallback(report_path=str(tmp_path / f"{optimizer}.json"), verbose=False)
        trainer = quiet_trainer(max_steps=30, callbacks=[cb])
        trainer.fit(Classifier(mlp(), lr=0.01, optimizer=optimizer),
                    with_replacement_loader(*digits, batch_size=16, num_samples=16 * 30, seed=0))
        assert words in read_report(tmp_path / f"{optimizer}.json")["critical_batch"]["calibration"]


class OneCycle(Classifier):
    """SGD under ``OneCycleLR``, which sets the LR at every step from ``max_lr``."""

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=200)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def test_a_schedule_that_sets_the_lr_itself_is_told_to_scale_its_peak(digits, tmp_path):
    """The LR the recommendation scales is OneCycle's start, ``max_lr/25``: the note says what to change instead, by
    the same factor. Before, only ``lr=`` and a LinearLR warmup were printed, which OneCycleLR overrides."""
    cb = GradientNoiseScaleCallback(report_path=str(tmp_path / "r.json"), verbose=False)
    quiet_trainer(max_epochs=1, callbacks=[cb]).fit(
        OneCycle(mlp()), with_replacement_loader(*digits, batch_size=8, num_samples=8 * 200, seed=0))
    rec = cb.recommendation
    factor = rec.learning_rate / (0.05 / 25)
    note = [n for n in rec.notes if n.startswith("OneCycleLR sets the learning rate")]
    assert note and f"×{factor:.3g}" in note[0] and f"max_lr={0.05 * factor:.4g}" in note[0], rec.notes


class TwoGroups(Classifier):
    """SGD with the first layer's group held at LR 0 (a frozen backbone) and the head's at 0.2."""

    def configure_optimizers(self):
        return torch.optim.SGD([{"params": self.net[0].parameters(), "lr": 0.0},
                                {"params": self.net[2].parameters(), "lr": 0.2}])


def test_param_groups_at_different_lrs_are_read_at_the_largest_and_each_is_scaled(digits, tmp_path):
    """Before, the first group's LR stood for the run: the recommended LR was 0 ('SGD(params, lr=0)'), and an LR
    increase was never held at the stability limit, which binds the largest group."""
    cb = GradientNoiseScaleCallback(report_path=str(tmp_path / "r.json"), verbose=False)
    quiet_trainer(max_epochs=1, callbacks=[cb]).fit(
        TwoGroups(mlp()), with_replacement_loader(*digits, batch_size=8, num_samples=8 * 200, seed=0))
    rec = cb.recommendation
    assert rec.current.learning_rate == 0.2 and rec.learning_rate > 0
    factor = rec.learning_rate / 0.2
    note = [n for n in rec.notes if n.startswith("the optimizer's 2 param groups run at different LRs (0, 0.2)")]
    assert note and f"×{factor:.3g}" in note[0] and f"lr=0, {rec.learning_rate:.4g}" in note[0], rec.notes
