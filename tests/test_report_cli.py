"""``python -m gns_callback report``: each flag changes the output as ``--help`` documents, errors name the fix.

Expected tables come from :func:`recommend` called directly with the inputs the command should have read
(from its flags and the report), so these tests check the command's wiring, not a particular LR rule.
"""

import json
import os
import re
import sys

import pytest

pytest.importorskip("matplotlib")

from gns_callback import report_cli  # noqa: E402
from gns_callback.estimate import GNSEstimate  # noqa: E402
from gns_callback.recommendation import Recommendation, recommend  # noqa: E402
from tests import report_sections  # noqa: E402
from tests.report_sections import CALLBACK_INPUTS, estimate  # noqa: E402

PNGS = ("gns_history.png", "gns_tradeoff.png", "gns_probe.png", "gns_objectives.png")


def write(path, report):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, allow_nan=False))
    return path


@pytest.fixture
def report():
    return report_sections.report()


@pytest.fixture
def report_path(report, tmp_path):
    return write(tmp_path / "gns_report.json", report)


def run(capsys, *argv):
    """The command's stdout (it must exit 0)."""
    assert report_cli.main([str(a) for a in argv]) == 0
    return capsys.readouterr().out


def fails(capsys, *argv) -> tuple[int, str]:
    with pytest.raises(SystemExit) as err:
        report_cli.main([str(a) for a in argv])
    return err.value.code, capsys.readouterr().err


def expected(report, **changes) -> str:
    """The table the command should print: ``recommend`` with what it reads from ``report``, then ``changes``.

    From the report: the batch, LR and optimizer of the recommendation's current point, the split, and the
    steps per epoch at that batch (``ceil(1797/16) = 113``).
    """
    saved = Recommendation.from_dict(report["recommendation"])
    inputs = {**CALLBACK_INPUTS, "dataset_size": None, "steps_per_epoch": saved.current.steps_per_epoch}
    inputs.update(changes)
    section = inputs.pop("section", "run_estimate")
    return recommend(report[section], probe=report.get("probe"), **inputs).summary_table()


def row(text: str, label: str) -> list[str]:
    """The cells after ``label`` in the printed table (split on runs of 2+ spaces)."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(label + "  ")]
    return re.split(r"\s{2,}", line[len(label):].strip())


def test_no_flag_prints_the_saved_recommendation_and_all_pngs(report, report_path, capsys, tmp_path):
    text = run(capsys, report_path)
    assert Recommendation.from_dict(report["recommendation"]).summary_table() in text
    assert "recomputed" not in text
    for name in PNGS:
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(tmp_path / name) in text


def test_recomputing_with_every_value_from_the_report_reproduces_the_saved_table(report, tmp_path, capsys):
    """With the data-set size recorded (``run.dataset_size``), the report holds every input the callback used."""
    report["run"]["dataset_size"] = 1797
    path = write(tmp_path / "r.json", report)
    text = run(capsys, path, "--no-plots", "--estimate", "run_estimate")
    assert Recommendation.from_dict(report["recommendation"]).summary_table() in text
    for line in ("batch size: 16  (the report's recommendation)", "learning rate: 0.1  (the report's recommendation)",
                 "optimizer: SGD  (the report's recommendation)", "accumulate: 2  (run.accumulate_grad_batches)",
                 "dataset size: 1797  (run.dataset_size)"):
        assert line in text


def test_optimizer_is_read_from_the_report(report, report_path, capsys):
    """The issue: without --optimizer the rule switched from SGD's to the unknown-optimizer default."""
    text = run(capsys, report_path, "--no-plots", "--max-batch-size", "1000")
    sgd = expected(report, max_batch_size=1000)
    assert sgd in text and "optimizer: SGD  (the report's recommendation)" in text
    assert expected(report, max_batch_size=1000, optimizer=None) != sgd  # the check can fail


def test_batch_size_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--batch-size", "32")
    assert expected(report, current_batch_size=32, current_lr=None, current_micro_batch_size=None,
                    steps_per_epoch=None) in text
    assert row(text, "global batch size")[0] == "32"
    assert "no learning-rate advice: the report's LR 0.1 was used at batch 16, not 32; pass --lr" in text
    assert "epoch length unknown" in text


def test_lr_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--lr", "0.2")
    assert expected(report, current_lr=0.2) in text
    assert row(text, "learning rate")[0] == "0.2" and "learning rate: 0.2  (--lr)" in text
    text = run(capsys, report_path, "--no-plots", "--batch-size", "32", "--lr", "0.3")
    assert expected(report, current_batch_size=32, current_lr=0.3, current_micro_batch_size=None,
                    steps_per_epoch=None) in text


def test_optimizer_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--optimizer", "AdamW")
    adamw = expected(report, optimizer="AdamW")
    assert adamw in text and adamw != expected(report)
    assert "optimizer: AdamW  (--optimizer)" in text


def test_lr_rule_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--lr-rule", "none")
    assert expected(report, lr_rule="none") in text
    current_lr, new_lr = row(text, "learning rate")
    assert current_lr == new_lr == "0.1"
    text = run(capsys, report_path, "--no-plots", "--lr-rule", "none", "--optimizer", "AdamW")
    assert "--optimizer does not pick the LR rule here: --lr-rule overrides it" in text
    code, err = fails(capsys, report_path, "--lr-rule", "cubic")
    assert code == 2 and "--lr-rule cubic: not a rule; use one of" in err


def test_devices_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--devices", "2")
    assert expected(report, num_devices=2, current_micro_batch_size=None) in text
    assert row(text, "micro × accumulate × devices")[1].endswith("× 2")


def test_accumulate_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--accumulate", "4")
    assert expected(report, current_accumulate=4, current_micro_batch_size=None) in text
    assert row(text, "micro × accumulate × devices")[0] == "4 × 4 × 1"
    code, err = fails(capsys, report_path, "--accumulate", "3")
    assert code == 2 and "the current batch does not split: batch size 16 (the report's recommendation), " \
        "accumulate 3 (--accumulate), devices 1 (run.world_size)" in err


def test_dataset_size_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--dataset-size", "1000")
    assert expected(report, dataset_size=1000, steps_per_epoch=None) in text
    batch = int(row(text, "global batch size")[1])
    assert row(text, "steps per epoch") == ["63", str(-(-1000 // batch))]  # ceil(1000/16), ceil(1000/B)


def test_max_batch_size_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--max-batch-size", "48")
    assert expected(report, max_batch_size=48) in text and int(row(text, "global batch size")[1]) <= 48
    text = run(capsys, report_path, "--no-plots", "--max-batch-size", "4096")
    assert "--max-batch-size 4096 is not binding: the target B_simple = 76.4 lies below it" in text


def test_flags_that_move_the_batch_say_so_when_the_batch_is_kept(tmp_path, capsys):
    path = write(tmp_path / "r.json", report_sections.report(estimate(300.0, 10.0, 2000.0)))  # holds the batch 16
    text = run(capsys, path, "--no-plots", "--max-batch-size", "48", "--power-of-two")
    for flag in ("--max-batch-size", "--power-of-two"):
        assert f"{flag} had no effect: status too_wide keeps the current batch 16" in text
    assert row(text, "global batch size") == ["16", "16"]


def test_power_of_two_flag(report, tmp_path, capsys):
    report["config"]["recommend_options"] = {"power_of_two": True}
    path = write(tmp_path / "r.json", report)
    text = run(capsys, path, "--no-plots", "--no-power-of-two")
    assert expected(report, power_of_two=False) in text and "power_of_two: False  (--power-of-two)" in text
    text = run(capsys, path, "--no-plots", "--lr", "0.1")  # the recorded option, no flag
    assert expected(report, power_of_two=True) in text and "power_of_two: True  (config.recommend_options)" in text
    batch = int(row(text, "global batch size")[1])
    assert batch & (batch - 1) == 0


def test_price_flag(report, report_path, tmp_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--price-per-device-hour", "2.5")
    assert expected(report, price_per_device_hour=2.5) in text and len(row(text, "cost per epoch")) == 2
    no_probe = {**report, "probe": None}
    text = run(capsys, write(tmp_path / "np.json", no_probe), "--no-plots", "--price-per-device-hour", "2.5")
    assert "--price-per-device-hour had no effect: a cost needs the time per epoch" in text
    assert "cost per epoch" not in text


def test_estimate_flag(report, report_path, capsys):
    text = run(capsys, report_path, "--no-plots", "--estimate", "estimate")
    assert expected(report, section="estimate") in text and "B_simple = 110 (95% CI 80 – 160" in text
    code, err = fails(capsys, report_path, "--estimate", "history")
    assert code == 2 and "--estimate history: the report has no such estimate; it has: estimate, run_estimate" in err


def test_recorded_callback_options_and_a_user_lr_rule_are_kept(tmp_path, capsys):
    report = report_sections.report(optimizer="MyOptimizer", lr_rule="linear")
    report["config"]["recommend_options"] = {"max_batch_size": 24, "multiple_of": 8}
    path = write(tmp_path / "r.json", report)
    text = run(capsys, path, "--no-plots", "--lr", "0.2")
    assert expected(report, optimizer="MyOptimizer", lr_rule="linear", current_lr=0.2, max_batch_size=24,
                    multiple_of=8) in text
    assert "lr_rule: linear  (the report (a user override))" in text
    assert "max_batch_size: 24  (config.recommend_options)" in text


def test_out_and_no_plots(report_path, tmp_path, capsys):
    out = tmp_path / "pictures"
    text = run(capsys, report_path, "--out", out)
    assert sorted(p.name for p in out.iterdir()) == sorted(PNGS) and "wrote history" in text
    run(capsys, report_path, "--no-plots")
    assert not (tmp_path / PNGS[0]).exists()
    code, err = fails(capsys, report_path, "--out", out, "--no-plots")
    assert code == 2 and "--out has no effect with --no-plots" in err


def test_out_that_is_a_file_is_refused(report_path, tmp_path, capsys):
    """Before, ``--out`` naming a file (or a folder under one) ended in a FileExistsError traceback."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    code, err = fails(capsys, report_path, "--out", a_file)
    assert code == 2 and f"--out {a_file} is a file: pass a folder for the PNGs" in err
    code, err = fails(capsys, report_path, "--out", a_file / "pictures")
    assert code == 2 and "could not write the pictures" in err and "--no-plots" in err


def test_help_documents_how_the_flags_depend_on_each_other(capsys):
    with pytest.raises(SystemExit) as err:
        report_cli.main(["--help"])
    text = capsys.readouterr().out
    assert err.value.code == 0
    dependencies = " ".join(text.split("how the flags depend on each other:")[1].split())
    for flag in ("--batch-size", "--lr", "--optimizer", "--lr-rule", "--max-batch-size", "--power-of-two",
                 "--dataset-size", "--price-per-device-hour", "--out", "--no-plots"):
        assert flag in dependencies, flag
    assert "--max-batch-size and --power-of-two act only when the batch moves (status ok or toward_interval)" in dependencies
    assert "--batch-size is required only when the report has no recommendation section" in dependencies


def test_warmup_steps_come_from_the_dataset_size(tmp_path, capsys):
    """No epoch length in the report (an IterableDataset): the command says how to get warmup steps."""
    big = estimate(600.0, 500.0, 700.0)
    report = report_sections.report(big, dataset_size=None, optimizer="Adam")  # Adam: the LR rises with the batch
    saved = Recommendation.from_dict(report["recommendation"])
    assert saved.warmup_steps is None and saved.warmup_epochs > 0  # the LR grows enough to need a warmup
    path = write(tmp_path / "r.json", report)
    text = run(capsys, path, "--no-plots")
    assert "Rerun this command with --dataset-size N" in text
    text = run(capsys, path, "--no-plots", "--dataset-size", "60000")
    rec = recommend(big, probe=report["probe"], **{**CALLBACK_INPUTS, "optimizer": "Adam", "dataset_size": 60000})
    assert rec.warmup_steps and f"Warmup: {rec.warmup_steps} steps" in text and "Rerun this command" not in text


@pytest.mark.parametrize(
    "content, problem",
    [
        ("epoch,loss\n1,0.3\n", "is not a GNS report: it is not JSON (Expecting value at line 1, column 1)"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe", "is not a GNS report: it is not text"),
        ("[1, 2]", "is JSON but not a GNS report: it has none of the sections estimate, run_estimate"),
        ('{"loss": 0.3}', "is JSON but not a GNS report"),
    ],
)
def test_files_that_are_not_reports(tmp_path, capsys, content, problem):
    path = tmp_path / "metrics.csv"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err = fails(capsys, path)
    assert code == 1 and problem in err and "pass the gns_report.json that GradientNoiseScaleCallback wrote" in err


def test_paths_and_bad_numbers(report, report_path, tmp_path, capsys):
    assert fails(capsys, tmp_path / "missing")[0] == 1
    (tmp_path / "empty").mkdir()
    code, err = fails(capsys, tmp_path / "empty")
    assert code == 1 and "no gns_report.json under" in err
    for flag, value in (("--batch-size", "0"), ("--devices", "two"), ("--lr", "-1"), ("--price-per-device-hour", "0")):
        code, err = fails(capsys, report_path, flag, value)
        assert code == 2 and f"argument {flag}: must be a positive" in err


def test_report_without_a_recommendation_needs_the_batch_size(tmp_path, capsys):
    path = write(tmp_path / "r.json", {"estimate": estimate()})
    text = run(capsys, path)
    assert "no recommendation in the report: pass --batch-size (and --lr) to compute one" in text
    assert (tmp_path / "gns_tradeoff.png").exists() and not (tmp_path / "gns_history.png").exists()
    code, err = fails(capsys, path, "--lr", "0.1")
    assert code == 2 and "the current batch size is unknown" in err and "pass --batch-size" in err
    text = run(capsys, path, "--no-plots", "--batch-size", "16", "--optimizer", "AdamW", "--lr", "0.001")
    assert recommend(estimate(), current_batch_size=16, current_lr=0.001, optimizer="AdamW").summary_table() in text
    assert "estimate: estimate  (the only estimate in the report)" in text


def test_old_reports_still_read(report, tmp_path, capsys):
    """A recommendation without a recorded optimizer, and one from an incompatible version."""
    unnamed = report_sections.report(optimizer=None)
    text = run(capsys, write(tmp_path / "a" / "gns_report.json", unnamed), "--no-plots", "--lr", "0.1")
    assert "no optimizer recorded in the report" in text
    broken = {**report, "recommendation": {"status": "ok", "batch_size": 64}}
    path = write(tmp_path / "b" / "gns_report.json", broken)
    assert report_cli.main([str(path)]) == 0
    captured = capsys.readouterr()
    assert "warning: unreadable recommendation section" in captured.err
    assert (tmp_path / "b" / "gns_tradeoff.png").exists()


def test_a_run_directory_uses_the_newest_report(report, tmp_path, capsys):
    old = write(tmp_path / "run" / "version_0" / "gns_report.json", {"estimate": estimate()})
    new = write(tmp_path / "run" / "version_1" / "nested" / "gns_report.json", report)
    os.utime(old, (1_000, 1_000))
    assert report_cli.find_report(tmp_path / "run") == new
    assert f"report: {new}" in run(capsys, tmp_path / "run", "--no-plots")


def test_a_real_run_end_to_end(digits, tmp_path, capsys):
    """Digits MLP with the callback (probe on): the command draws all three pictures from the report it wrote,
    and recomputing from the report alone gives the callback's batch, split, learning rate and rule."""
    from gns_callback import GradientNoiseScaleCallback
    from tests.helpers import Classifier, mlp, quiet_trainer, with_replacement_loader

    cb = GradientNoiseScaleCallback(probe=True, memory_budget_bytes=2_000_000, log_every_n_steps=20, verbose=False,
                                    report_path=str(tmp_path / "run" / "gns_report.json"))
    quiet_trainer(max_epochs=1, callbacks=[cb]).fit(
        Classifier(mlp(), lr=0.05), with_replacement_loader(*digits, batch_size=8, num_samples=8 * 200, seed=0))
    text = run(capsys, tmp_path / "run", "--out", tmp_path / "pngs")
    assert sorted(p.name for p in (tmp_path / "pngs").iterdir()) == sorted(PNGS)
    assert cb.recommendation.summary_table() in text
    text = run(capsys, tmp_path / "run", "--no-plots")  # default: the batch target the callback recommended from
    saved = cb.recommendation
    for label, value in (("global batch size", saved.batch_size), ("learning rate", f"{saved.learning_rate:.4g}")):
        assert row(text, label)[1] == str(value)
    assert row(text, "micro × accumulate × devices")[1] == (
        f"{saved.micro_batch_size} × {saved.accumulate_grad_batches} × {saved.num_devices}")
    assert f"LR rule: {saved.lr_rule} ({saved.lr_rule_source})" in text and f"Status: {saved.status}" in text


def test_without_matplotlib_the_recommendation_is_still_printed(report, report_path, capsys, monkeypatch):
    """matplotlib is optional (the ``plots`` extra). Before, the command stopped with its ``ModuleNotFoundError``
    traceback, before printing the recommendation."""
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib... raises ModuleNotFoundError
    assert report_cli.main([str(report_path)]) == 0
    captured = capsys.readouterr()
    assert Recommendation.from_dict(report["recommendation"]).summary_table() in captured.out
    assert "no plots: matplotlib is not installed (pip install matplotlib, or 'gns_callback[plots]')" in captured.err
    assert "Status:" in run(capsys, report_path, "--no-plots")  # the recommendation alone: no warning needed


def test_the_command_says_what_was_measured_and_that_the_fit_was_interrupted(tmp_path, capsys):
    """Before, the report of a fit stopped by Ctrl-C (no recommendation section: it is computed at fit end) gave only
    "no recommendation in the report: pass --batch-size (and --lr) to compute one", and one of a fit that measured no
    step said the same, though nothing could be computed from it."""
    interrupted = {"estimate": estimate(), "run_estimate": estimate(), "run": {"interrupted": "KeyboardInterrupt"}}
    text = run(capsys, write(tmp_path / "a" / "gns_report.json", interrupted), "--no-plots")
    assert "the fit was interrupted (KeyboardInterrupt); the report holds the steps measured before that" in text
    assert f"run average: {GNSEstimate.from_dict(estimate())}" in text
    no_step = {**estimate(), "b_simple": None, "grad_sq_norm": None, "trace_sigma": None, "ci_low": 0.0,
               "ci_high": None, "steps": 0}
    text = run(capsys, write(tmp_path / "b" / "gns_report.json", {"run_estimate": no_step}), "--no-plots")
    assert "run average: B_simple not measured (no optimizer step measured" in text
    assert "no measured estimate to compute one from" in text and "pass --batch-size" not in text


def test_a_reader_that_goes_away_ends_the_command_quietly(report_path):
    """``python -m gns_callback report ... | head -1``: before, a ``BrokenPipeError`` traceback on stderr."""
    import subprocess

    reader = subprocess.Popen([sys.executable, "-m", "gns_callback", "report", "--no-plots", str(report_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.close()  # the reader is gone before the first line
    _, err = reader.communicate(timeout=120)
    assert b"Traceback" not in err and reader.returncode == 1, err.decode()
