"""Gemma's RMSNorm, which scales by ``1 + weight``, in a real fit at the defaults. Before, its weight was left out
(read at the shift ``1 + weight``, whose output holds no examples)."""

from tests.trust.models import GemmaStyle
from tests.trust.setups import assert_fit_measures_whole


def test_norms_scaled_by_one_plus_their_weight_are_measured_whole(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(GemmaStyle, (x * 16).round().long(), y, exact_gns, tmp_path)
