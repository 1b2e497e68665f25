"""Swin's windows stacked as rows, ``(B·nW, T, C)``, in a real fit at the defaults. Before, the first attention
layer's input, which holds no batch of B in any dim, stopped the measurement at the first step ("not measured")."""

from tests.trust.models import SwinStyle
from tests.trust.setups import assert_fit_measures_whole


def test_a_swin_style_model_is_measured_whole(digits, exact_gns, tmp_path):
    assert_fit_measures_whole(SwinStyle, *digits, exact_gns, tmp_path)
