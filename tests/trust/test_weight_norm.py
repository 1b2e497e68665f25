"""Weight-normalised layers in a real fit at the defaults. Before, their ``g`` and ``v`` were left out: on this model
every weight (1% of the parameters covered), and 86% of a digits MLP 64-32-10 with its first layer normalised."""

from tests.trust.models import WeightNormed
from tests.trust.setups import assert_fit_measures_whole


def test_weight_normalised_layers_are_measured_whole(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(WeightNormed, x, y, exact_gns, tmp_path)
