import json
import os

import pytest

pytest.importorskip("matplotlib")

from gns_callback import report_cli  # noqa: E402
from tests.recommendation.synthetic import synthetic_estimate, synthetic_report  # noqa: E402


def write(path, report):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, allow_nan=False))
    return path


def test_report_command_on_a_run_dir_uses_the_newest_report(tmp_path, capsys):
    old = write(tmp_path / "run" / "version_0" / "gns_report.json", {"estimate": synthetic_estimate()})
    new = write(tmp_path / "run" / "version_1" / "nested" / "gns_report.json", synthetic_report())
    os.utime(old, (1_000, 1_000))
    assert report_cli.find_report(tmp_path / "run") == new
    out = tmp_path / "plots"
    assert report_cli.main([str(tmp_path / "run"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    for name in ("gns_history.png", "gns_tradeoff.png", "gns_probe.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert str(out / name) in text
    assert str(new) in text
    assert "recommended" in text and "Trainer(devices=1, accumulate_grad_batches=" in text


def test_report_file_default_out_dir_and_no_recommendation(tmp_path, capsys):
    path = write(tmp_path / "r.json", {"estimate": synthetic_estimate()})
    report_cli.main([str(path)])
    text = capsys.readouterr().out
    assert (tmp_path / "gns_tradeoff.png").exists() and not (tmp_path / "gns_history.png").exists()
    assert "Lightning settings" not in text


def test_recompute_recommendation_from_the_command_line(tmp_path, capsys):
    report = synthetic_report()
    del report["recommendation"]
    path = write(tmp_path / "gns_report.json", report)
    report_cli.main([str(path), "--no-plots", "--batch-size", "16", "--lr", "0.001", "--optimizer", "AdamW",
                     "--dataset-size", "1797"])
    text = capsys.readouterr().out
    assert "sqrt" in text and "Malladi" in text and "DataLoader(dataset, batch_size=80)" in text
    assert not (tmp_path / "gns_tradeoff.png").exists()


def test_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        report_cli.main([str(tmp_path / "missing")])
    assert err.value.code == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit):
        report_cli.main([str(tmp_path / "empty")])
    assert "no gns_report.json" in capsys.readouterr().err
    path = write(tmp_path / "gns_report.json", {"estimate": synthetic_estimate()})
    with pytest.raises(SystemExit) as err:
        report_cli.main([str(path), "--batch-size", "64"])
    assert err.value.code == 2
