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
