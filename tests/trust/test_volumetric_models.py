"""A volumetric convolutional network (``nn.Conv3d``, most of its parameters) in a real fit. Before, its
convolutions were left out of the per-example norms: at one micro-batch per step the estimate was the head's
alone (B_simple = 127 [99, 176] against the whole model's exact 100.6, the head's being 127.3) and no batch was
recommended (``partial_coverage``)."""

import torch
import torch.nn.functional as F
from torch import nn

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.setups import with_and_without


def volume_net() -> nn.Module:
    """Each 8×8 digit as a 4×4×4 volume: two 3-D convolutions (58% of the parameters) and a Linear head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv3d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(16 * 64, 10))


def test_one_micro_batch_per_step_measures_a_conv3d_model_whole(digits, exact_gns, tmp_path):
    x, y = digits
    volumes = x.reshape(-1, 1, 4, 4, 4)
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    with_and_without(lambda: Classifier(volume_net()), lambda: with_replacement_loader(volumes, y, 32, 32 * 150),
                     callback)
    assert callback.run_estimate.method == "per_example" and callback.meter.coverage["fraction"] == 1.0
    assert_matches_exact(callback.run_estimate, exact_gns(volume_net(), F.cross_entropy, volumes, y)[0],
                         max_ci_ratio=3.0)
    assert callback.recommendation.status != "partial_coverage"
