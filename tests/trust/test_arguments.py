"""Issue 10, "Arguments": every constructor argument is checked at construction; the message names the argument,
shows the value, and gives a valid example. The values the issue lists were accepted, failed late, or failed with a
bare TypeError."""

import inspect
import os

import pytest
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from gns_callback import GradientNoiseScaleCallback
from gns_callback.callback import _ARGUMENTS
from tests.helpers import Classifier, mlp, with_replacement_loader
from tests.trust.setups import fit, trains_without_callback


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file.txt"
    path.write_text("")
    return path


BAD = [
    ("max_batch_size", 0, "e.g. 4096"), ("max_batch_size", -5, "e.g. 4096"),
    ("batch_multiple_of", 0, "e.g. 8"), ("batch_multiple_of", 2.5, "e.g. 8"),
    ("min_batch_size", -4, "e.g. 16"),
    ("price_per_device_hour", -1, "e.g. 2.5"), ("price_per_device_hour", "cheap", "e.g. 2.5"),
    ("summary_every_n_epochs", -1, "e.g. 1"), ("summary_every_n_epochs", "2", "e.g. 1"),
    ("log_every_n_steps", True, "e.g. 50"), ("log_every_n_steps", 0, "e.g. 50"),
    ("memory_budget_bytes", 0.5, "e.g. 8 * 2**30"), ("memory_budget_bytes", "1GB", "e.g. 8 * 2**30"),
    ("probe", "no", "True, False, or None"), ("verbose", 1, "True or False"), ("adapt", "yes", "True or False"),
    ("recommend", None, "True or False"), ("power_of_two", 0, "True or False"),
    ("headroom", "0.8", "e.g. 0.85"), ("headroom", None, "e.g. 0.85"), ("headroom", 0, "e.g. 0.85"),
    ("adapt_factor", 1.0, "e.g. 1.5"), ("adapt_factor", "x", "e.g. 1.5"),
    ("adapt_patience", 0, "e.g. 2"), ("adapt_patience", 1.5, "e.g. 2"),
    ("method", "magic", "e.g. 'auto'"), ("ema_decay", 1.0, "e.g. 0.99"), ("confidence", 95, "e.g. 0.95"),
    ("loss_reduction", "avg", "'mean'"), ("per_example_max_examples", 1, "e.g. 16"), ("lr_rule", "cubic", "'sqrt'"),
    ("report_path", 3, "a file path"),
]


@pytest.mark.parametrize("name, value, example", BAD)
def test_bad_values_are_refused_at_construction_naming_the_argument(name, value, example):
    with pytest.raises(ValueError) as error:
        GradientNoiseScaleCallback(**{name: value})
    message = str(error.value)
    assert message.startswith(f"GradientNoiseScaleCallback({name}={value!r}): must be "), message
    assert example in message, message


def test_adapt_arguments_are_checked_even_when_adapt_is_off():
    with pytest.raises(ValueError, match=r"\(adapt_factor=0.5\)"):
        GradientNoiseScaleCallback(adapt=False, adapt_factor=0.5)


def test_arguments_that_must_agree():
    with pytest.raises(ValueError, match=r"min_batch_size=64, max_batch_size=32.*e\.g\. min_batch_size=16"):
        GradientNoiseScaleCallback(min_batch_size=64, max_batch_size=32)
    with pytest.raises(ValueError, match="adapt=True, recommend=False"):
        GradientNoiseScaleCallback(adapt=True, recommend=False)


@pytest.mark.parametrize("option", [dict(objective="time"), dict(max_batch_size=512), dict(power_of_two=True),
                                    dict(batch_multiple_of=16), dict(price_per_device_hour=2.0), dict(max_devices=4)])
def test_recommendation_options_with_recommend_false_are_refused(option):
    """Before, they did nothing, without a word (``objective='time'`` still ran a probe for a plan no one saw)."""
    (name, value), = option.items()
    with pytest.raises(ValueError, match=rf"recommend=False, {name}={value!r}\): .*set recommend=True, or drop"):
        GradientNoiseScaleCallback(recommend=False, **option)
    GradientNoiseScaleCallback(recommend=False, max_batch_size=None, objective="balanced")  # defaults: fine


def test_report_paths_that_cannot_take_the_report(tmp_path, a_file):
    with pytest.raises(ValueError, match="not an existing directory"):
        GradientNoiseScaleCallback(report_path=str(tmp_path))
    with pytest.raises(ValueError, match="is a file"):
        GradientNoiseScaleCallback(report_path=str(a_file / "report.json"))
    assert os.listdir(tmp_path) == ["a_file.txt"]  # nothing written by the check (no stray .tmp)


def test_valid_values_are_kept(tmp_path):
    cb = GradientNoiseScaleCallback(memory_budget_bytes=2e9, price_per_device_hour=0, min_batch_size=8,
                                    max_batch_size=8, report_path=str(tmp_path / "new" / "folder" / "r.json"))
    assert cb.memory_budget_bytes == 2_000_000_000 and isinstance(cb.memory_budget_bytes, int)
    assert not (tmp_path / "new").exists()  # folders are created only when the report is written


def test_every_constructor_argument_has_a_rule():
    names = set(inspect.signature(GradientNoiseScaleCallback.__init__).parameters) - {"self"}
    assert names == set(_ARGUMENTS)


def test_an_unwritable_default_report_path_is_refused_at_fit_start(digits, a_file):
    """The default path (under the Trainer's log dir) is known only at fit start: checked there, before any step."""
    x, y = digits
    loader = lambda: with_replacement_loader(x, y, 8, 64)  # noqa: E731
    trains_without_callback(lambda: Classifier(mlp()), loader, default_root_dir=str(a_file / "logs"))
    with pytest.raises(MisconfigurationException, match=r"report can't be written.*is a file.*report_path="):
        fit(Classifier(mlp()), loader(), (GradientNoiseScaleCallback(),), default_root_dir=str(a_file / "logs"))


def test_a_report_that_cannot_be_written_at_fit_end_warns_and_keeps_the_result(digits, tmp_path, monkeypatch):
    """E.g. a full disk: the finished run is not failed for it."""
    x, y = digits

    def disk_full(path, sections):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gns_callback.callback.write_report", disk_full)
    callback = GradientNoiseScaleCallback(method="micro_batch", verbose=False, report_path=str(tmp_path / "r.json"))
    with pytest.warns(UserWarning, match="could not write the report.*No space left"):
        trainer = fit(Classifier(mlp()), with_replacement_loader(x, y, 8, 8 * 2 * 10), (callback,),
                      accumulate_grad_batches=2)
    assert trainer.state.finished and callback.run_estimate.steps == 10


def test_numpy_numbers_are_taken_as_python_numbers_through_the_fit(digits, tmp_path):
    """``max_devices=np.int64(2)`` passed the constructor's check, then ``recommend()`` raised "max_devices must be a
    positive int" at the first logging step, ending the user's run. Every numeric argument is now Python's own."""
    import json

    import numpy as np

    x, y = digits
    numbers = dict(log_every_n_steps=np.int64(5), per_example_max_examples=np.int64(8), headroom=np.float64(0.8),
                   min_batch_size=np.int64(8), max_batch_size=np.int64(256), batch_multiple_of=np.int64(8),
                   price_per_device_hour=np.float32(2.0), summary_every_n_epochs=np.int64(1),
                   adapt_factor=np.float64(2.0), adapt_patience=np.int64(2), max_devices=np.int64(2),
                   measure_every_n_steps=np.int64(2))
    callback = GradientNoiseScaleCallback(**numbers, verbose=False, report_path=str(tmp_path / "r.json"))
    trainer = fit(Classifier(mlp()), with_replacement_loader(x, y, 16, 16 * 20), (callback,))
    assert trainer.state.finished and callback.run_estimate.steps == 10
    config = json.loads((tmp_path / "r.json").read_text())["config"]
    assert config["recommend_options"]["max_devices"] == 2 and config["per_example_max_examples"] == 8


def test_a_report_that_cannot_be_serialised_warns_and_keeps_the_result(digits, tmp_path, monkeypatch):
    """Any failure to write the report at fit end warns, not only a full disk (``OSError``): the run has finished."""
    x, y = digits

    def unserialisable(path, sections):
        raise TypeError("Object of type Thing is not JSON serializable")

    monkeypatch.setattr("gns_callback.callback.write_report", unserialisable)
    callback = GradientNoiseScaleCallback(method="micro_batch", verbose=False, report_path=str(tmp_path / "r.json"))
    with pytest.warns(UserWarning, match="could not write the report.*TypeError.*cb.estimate"):
        trainer = fit(Classifier(mlp()), with_replacement_loader(x, y, 8, 8 * 2 * 10), (callback,),
                      accumulate_grad_batches=2)
    assert trainer.state.finished and callback.run_estimate.steps == 10
