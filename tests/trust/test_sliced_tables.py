"""A learned position table longer than the sequence, sliced to its length (minGPT's ``x + self.pos_emb[:, :T]``), in
a real fit (:mod:`gns_callback.per_example.param_path`). Before, the slice left the table out: 32% of this model's
parameters, so the estimate was the rest's and no batch was recommended (``partial_coverage``): benchmarks/RESULTS.md,
"Bare parameters through a slice"."""

import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.models import seeded_min_gpt as min_gpt
from tests.trust.setups import with_and_without


def test_one_micro_batch_per_step_measures_a_sliced_position_table(digits, exact_gns, tmp_path):
    x, y = digits
    tokens = (x * 16).round().long()
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    with_and_without(lambda: Classifier(min_gpt()), lambda: with_replacement_loader(tokens, y, 32, 32 * 150),
                     callback)
    assert callback.run_estimate.method == "per_example" and callback.meter.coverage["fraction"] == 1.0
    exact = exact_gns(min_gpt(), F.cross_entropy, tokens, y)[0]
    assert_matches_exact(callback.run_estimate, exact, max_ci_ratio=3.0)
    assert callback.recommendation.status != "partial_coverage"
