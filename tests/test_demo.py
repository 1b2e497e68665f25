"""The README's main job runs and prints the estimate."""

import json

import pytest

from gns_callback.__main__ import main


def test_demo_prints_the_estimate_and_writes_the_report(tmp_path, capsys):
    main(["demo", "--epochs", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "B_simple = " in out and "per_example" in out
    report = next(tmp_path.rglob("gns_report.json"))
    estimate = json.loads(report.read_text())["estimate"]
    assert estimate["steps"] == 47 and estimate["b_simple"] > 0  # 1500 examples / batch 32


def test_unknown_command_prints_usage(capsys):
    with pytest.raises(SystemExit) as err:
        main(["nope"])
    assert err.value.code == 2 and "usage" in capsys.readouterr().out


@pytest.mark.parametrize("flags, says", [
    (["--epochs", "0"], "argument --epochs: must be a positive integer"),          # before: KeyError 'val_acc'
    (["--accumulate", "0"], "argument --accumulate: must be a positive integer"),  # ZeroDivisionError
    (["--batch-size", "-5"], "argument --batch-size: must be a positive integer"),  # the DataLoader's ValueError
    (["--lr", "nan"], "argument --lr: must be a positive number"),                # trained on NaN weights
])
def test_bad_flags_are_refused_before_training(flags, says, capsys):
    with pytest.raises(SystemExit) as err:
        main(["demo", *flags])
    assert err.value.code == 2 and says in capsys.readouterr().err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    """Before: NotADirectoryError from the logger, after the data had loaded."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    with pytest.raises(SystemExit) as err:
        main(["demo", "--out", str(a_file)])
    assert err.value.code == 2 and "is a file: pass a folder" in capsys.readouterr().err
