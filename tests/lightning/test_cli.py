"""LightningCLI of either namespace builds the callback from YAML (``class_path: gns_callback...``), fits, and the
report it writes carries the YAML's settings and a measurement that matches the exact value."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback, load_estimate, read_report
from gns_callback.exact import exact_b_simple
from tests.helpers import assert_matches_exact
from tests.lightning.modules import digits_classifier, digits_net, digits_tensors

CONFIG = """\
seed_everything: 0
trainer:
  accelerator: cpu
  max_epochs: 1
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: gns_callback.GradientNoiseScaleCallback
      init_args:
        method: per_example
        log_every_n_steps: 25
        per_example_max_examples: null
        report_path: {report}
        verbose: false
model:
  lr: 0.0
  batch_size: 32
  micro_batches: 100
"""


@pytest.fixture(scope="module")
def exact_value() -> float:
    return exact_b_simple(digits_net(), F.cross_entropy, *digits_tensors())[0]


def test_lightning_cli_yaml_fits_and_writes_the_report(namespace, tmp_path, exact_value):
    pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (in the test extra)")
    report = tmp_path / "gns" / "report.json"
    config = tmp_path / "gns.yaml"
    config.write_text(CONFIG.format(report=report))

    cli = namespace.sub("cli").LightningCLI(digits_classifier(namespace.name), args=["fit", "--config", str(config)])

    (callback,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, GradientNoiseScaleCallback)]
    assert callback.method == "per_example" and callback.per_example_max_examples is None
    sections = read_report(report)
    assert sections["config"]["method"] == "per_example"
    assert [point["step"] for point in sections["history"]] == [25, 50, 75, 100]
    estimate = load_estimate(report, "run_estimate")
    assert estimate.steps == cli.trainer.global_step == 100
    assert_matches_exact(estimate, exact_value)
