"""Layer norms of the model's own code, in a real fit at the defaults: nanoGPT's ``LayerNorm`` (``F.layer_norm`` with a
weight and an optional bias) and SqueezeBERT's channels-first subclass of ``nn.LayerNorm``. Before, their parameters
were left out (used through the layer norm's own autograd node, which was not read)."""

from tests.trust.models import LayerNormsOfTheirOwn
from tests.trust.setups import assert_fit_measures_whole


def test_layer_norms_of_their_own_are_measured_whole(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(LayerNormsOfTheirOwn, (x * 16).round().long(), y, exact_gns, tmp_path)
