"""Issue 10 item 7: DDP with the default ``report_path`` crashed at fit end under ``ddp`` and ``ddp_spawn``, with or
without a logger: ``on_fit_end`` called ``trainer.log_dir`` (a collective broadcast) on rank 0 only. The path is now
resolved on every rank at fit start. Every existing DDP test passed an explicit ``report_path``; these use the
defaults. One of them also has a model per-example hooks can't measure (a Linear applied to the data and to a
learned table of prototypes): both ranks agree to switch to ``micro_batch`` at the same step (any disagreement would
hang the run in its next all-reduce). Another has a Linear applied twice, which they measure as one call over both
(``per_example/repeated.py``), and a third a sequence layer whose per-example norms are sketched, each rank drawing
its own probes (``per_example/sketch.py``). A fourth is a ViT whose class token and position table (10% of it) are
bare parameters: ``auto`` does not count on them at fit start and takes ``micro_batch``; asked for ``per_example``,
each rank reads them per example at their broadcasts (``per_example/broadcast.py``), as it reads a hand-written
model's weights at their matrix products (``per_example/matmul.py``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

from gns_callback import load_estimate
from tests.helpers import assert_matches_exact
from tests.trust.ddp_fit import MODELS, ddp_fit, digits, reports

pytestmark = pytest.mark.usefixtures("file_system_sharing")
STEPS = 150
REPO = Path(__file__).resolve().parents[2]


_EXACT = {}


def load_exact(model):
    if model not in _EXACT:
        from gns_callback.exact import exact_b_simple

        _EXACT[model] = exact_b_simple(MODELS[model](), F.cross_entropy, *digits())[0]
    return _EXACT[model]


@pytest.mark.parametrize("model, logger, method", [("linear_on_table", True, "micro_batch"),
                                                  ("linear_twice", False, "per_example"),
                                                  ("pixel_tokens", False, "per_example"),  # sketched norms
                                                  ("vit", False, "micro_batch")])  # bare parameters: below
def test_ddp_spawn_with_the_default_report_path(tmp_path, model, logger, method):
    baseline = ddp_fit(str(tmp_path / "baseline"), "ddp_spawn", model, logger, with_callback=False, steps=5)
    assert baseline.state.finished
    ddp_fit(str(tmp_path), "ddp_spawn", model, logger, with_callback=True, steps=STEPS)
    (report,) = reports(str(tmp_path))
    expected_dir = tmp_path / "lightning_logs" / "version_0" if logger else tmp_path
    assert Path(report) == expected_dir / "gns_report.json"
    run = load_estimate(report, "run_estimate")
    assert run.method == method and json.loads(Path(report).read_text())["run"]["world_size"] == 2
    assert run.steps == (STEPS - 1 if model == "linear_on_table" else STEPS)  # the switch costs the first step
    assert_matches_exact(run, load_exact(model))


@pytest.mark.parametrize("model, widest", [("vit", 2.0), ("hand_written", 2.0), ("position_table", 2.0),
                                           ("relative_bias", 3.0),  # B_simple ≈ 4× its batch of 32: wider
                                           ("layer_used_outside", 2.0)])
def test_ddp_spawn_reads_bare_parameters_per_example(tmp_path, model, widest):
    """A layer whose parameters the model applies itself is handed to its caller on the first step, on both ranks,
    which then drop that step alike."""
    ddp_fit(str(tmp_path), "ddp_spawn", model, False, with_callback=True, steps=STEPS, method="per_example")
    (report,) = reports(str(tmp_path))
    run = load_estimate(report, "run_estimate")
    saved = json.loads(Path(report).read_text())
    assert run.method == "per_example" and saved["run"]["world_size"] == 2
    assert saved["coverage"]["fraction"] == 1.0
    assert run.steps == (STEPS - 1 if model == "layer_used_outside" else STEPS)
    assert_matches_exact(run, load_exact(model), max_ci_ratio=widest)


def run_script(root, model, logger, with_callback, steps):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "tests.trust.ddp_fit", str(root), model, str(int(logger)),
                           str(int(with_callback)), str(steps)], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((Path(root) / "result.json").read_text())


def test_ddp_script_with_the_default_report_path(tmp_path):
    (tmp_path / "baseline").mkdir()
    assert run_script(tmp_path / "baseline", "linear_on_table", True, False, 5)["global_step"] == 5
    result = run_script(tmp_path, "linear_on_table", True, True, STEPS)
    assert result["global_step"] == STEPS
    assert result["reports"] == [result["report_file"]]
    assert result["report_file"] == str(tmp_path / "lightning_logs" / "version_0" / "gns_report.json")
    run = load_estimate(result["report_file"], "run_estimate")
    assert run.method == "micro_batch" and run.steps == STEPS - 1
    assert_matches_exact(run, load_exact("linear_on_table"))
