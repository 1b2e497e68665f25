"""A bag-of-words classifier (``nn.EmbeddingBag``, most of its parameters) in a real fit. Before, the bag table was
left out of both norms, so one micro-batch per step measured the head alone and recommended nothing
(``partial_coverage``); each bag is now one example (:mod:`gns_callback.per_example.embedding_bag`)."""

import torch
import torch.nn.functional as F
from torch import nn

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.setups import with_and_without


class PixelBag(nn.Module):
    """Each digit as a bag of 64 tokens, one per (position, intensity), averaged; a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bag, self.head = nn.EmbeddingBag(17 * 64, 16, mode="mean"), nn.Linear(16, 10)
        with torch.no_grad():
            self.head.weight.mul_(4.0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.bag(tokens))


def test_one_micro_batch_per_step_measures_the_bag_model_whole(digits, exact_gns, tmp_path):
    x, y = digits
    tokens = (x * 16).round().long() + 17 * torch.arange(64)
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    with_and_without(lambda: Classifier(PixelBag()), lambda: with_replacement_loader(tokens, y, 32, 32 * 150),
                     callback)
    assert callback.run_estimate.method == "per_example" and callback.meter.coverage["fraction"] == 1.0
    assert_matches_exact(callback.run_estimate, exact_gns(PixelBag(), F.cross_entropy, tokens, y)[0], max_ci_ratio=3.0)
    assert callback.recommendation.status != "partial_coverage"
