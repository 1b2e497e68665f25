"""A ViT-style model in a real fit: its class token and position table are bare parameters, broadcast over the
batch (:mod:`gns_callback.per_example.broadcast`). Before, they were left out (10% of this model's parameters, a
large share of its gradient): the exact value was inside the intervals, but they were 16× wide and no batch was
recommended (``too_wide``; benchmarks/RESULTS.md, "A ViT-style model's bare parameters")."""

import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from benchmarks.model_scan import ViTStyle
from tests.trust.setups import with_and_without


def vit():
    torch.manual_seed(0)
    return ViTStyle()


def test_one_micro_batch_per_step_measures_a_vit_whole(digits, exact_gns, tmp_path):
    x, y = digits
    images = x.reshape(-1, 1, 8, 8)
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    with_and_without(lambda: Classifier(vit()), lambda: with_replacement_loader(images, y, 32, 32 * 150), callback)
    assert callback.run_estimate.method == "per_example" and callback.meter.coverage["fraction"] == 1.0
    exact = exact_gns(vit(), F.cross_entropy, images, y)[0]
    assert_matches_exact(callback.run_estimate, exact, max_ci_ratio=3.0)
    assert callback.recommendation.status not in ("partial_coverage", "too_wide")
