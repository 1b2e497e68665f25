"""A learned position table longer than the sequence, sliced to its length (minGPT's ``x + self.pos_emb[:, :T]``), in
a real fit (:mod:`gns_callback.per_example.param_path`). Before, the slice left the table out: 32% of this model's
parameters, so the estimate was the rest's and no batch was recommended (``partial_coverage``): benchmarks/RESULTS.md,
"Bare parameters through a slice"."""

from tests.trust.models import seeded_min_gpt as min_gpt
from tests.trust.setups import assert_fit_measures_whole


def test_one_micro_batch_per_step_measures_a_sliced_position_table(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(min_gpt, (x * 16).round().long(), y, exact_gns, tmp_path)
