"""A layer whose parameters the model applies itself, outside the layer's forward (Mamba's ``dt_proj``), in a real fit
at the defaults. Before, the first backward pass stopped the measurement ("received a gradient that did not flow
through its module's output"): nothing was measured. Now the first step is not measured, and from the next on the
parameters are read where the model uses them."""

from tests.trust.models import LayerUsedOutside
from tests.trust.setups import assert_fit_measures_whole


def test_a_layer_used_outside_its_forward_is_measured_whole_from_the_second_step(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(LayerUsedOutside, x, y, exact_gns, tmp_path)
