"""A learned relative-position bias added to attention logits, in a real fit at the defaults: T5's ``nn.Embedding`` of
distance buckets looked up on an (L, L) matrix with no batch dim, and Swin's bare table indexed by a buffer
(:mod:`gns_callback.per_example.param_path`). Before, T5's stopped the measurement at the first step ("neither dim 0
nor dim 1 holds the batch") and Swin's was left out (83% coverage, no batch recommended): benchmarks/RESULTS.md,
"Model types the tests were not written for"."""

from functools import partial

import pytest

from tests.trust.models import seeded_relative_bias
from tests.trust.setups import assert_fit_measures_whole


@pytest.mark.parametrize("swin", [False, True], ids=["T5 bucket embedding", "Swin indexed table"])
def test_one_micro_batch_per_step_measures_a_relative_position_bias(digits, exact_gns, tmp_path, swin):
    x, y = digits
    assert_fit_measures_whole(partial(seeded_relative_bias, swin), (x * 16).round().long(), y, exact_gns, tmp_path)
