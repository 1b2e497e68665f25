"""objective= in the callback: refused without the probe, carried into the recommendation and the report."""

from types import SimpleNamespace

import pytest
import torch

from gns_callback import GradientNoiseScaleCallback, read_report
from tests.helpers import Classifier, mlp, quiet_trainer, with_replacement_loader


@pytest.mark.parametrize("objective", ["time", "cost"])
def test_time_and_cost_without_the_probe_are_refused_at_construction(objective):
    with pytest.raises(ValueError, match=rf"objective='{objective}', probe=False.*set probe=True"):
        GradientNoiseScaleCallback(objective=objective, probe=False)


def test_probe_default_is_on_for_an_accelerator_or_an_objective_that_needs_it():
    cpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")))
    gpu = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))  # no GPU needed
    assert not GradientNoiseScaleCallback()._probe_wanted(cpu)
    assert GradientNoiseScaleCallback()._probe_wanted(gpu)
    assert GradientNoiseScaleCallback(objective="time")._probe_wanted(cpu)
    assert not GradientNoiseScaleCallback(probe=False)._probe_wanted(gpu)
    assert GradientNoiseScaleCallback(probe=True)._probe_wanted(cpu)


def test_bad_objective_and_max_devices_name_the_fix():
    with pytest.raises(ValueError, match="objective"):
        GradientNoiseScaleCallback(objective="fastest", probe=True)
    with pytest.raises(ValueError, match="max_devices"):
        GradientNoiseScaleCallback(max_devices=0)
    with pytest.raises(ValueError, match="adapt=True, max_devices=4"):
        GradientNoiseScaleCallback(adapt=True, max_devices=4)


def test_time_objective_in_a_fit_reports_all_three_plans(digits, tmp_path):
    cb = GradientNoiseScaleCallback(probe=True, objective="time", report_path=str(tmp_path / "r.json"),
                                    memory_budget_bytes=4_000_000, verbose=False)
    quiet_trainer(max_epochs=1, callbacks=[cb]).fit(
        Classifier(mlp(), lr=0.05), with_replacement_loader(*digits, batch_size=8, num_samples=8 * 150, seed=0))
    rec = cb.recommendation
    assert rec.objective == "time" and set(rec.plans) == {"balanced", "time", "cost"}
    assert rec.plans["time"].status in ("ok", "kept") and rec.plans["time"].time is not None
    if rec.plans["time"].status == "ok":
        assert (rec.batch_size, rec.micro_batch_size) == (rec.plans["time"].batch_size,
                                                          rec.plans["time"].micro_batch_size)
    report = read_report(tmp_path / "r.json")
    assert report["recommendation"]["objective"] == "time"
    assert report["recommendation"]["plans"]["time"]["batch_size"] == rec.plans["time"].batch_size
    assert report["config"]["recommend_options"]["objective"] == "time"
