"""Swin's windows stacked as rows, ``(B·nW, T, C)``, in a real fit at the defaults. Before, the first attention
layer's input, which holds no batch of B in any dim, stopped the measurement at the first step ("not measured")."""

from functools import partial

from tests.trust.models import FusedWindowAttention, SwinStyle
from tests.trust.setups import assert_fit_measures_whole


def test_a_swin_style_model_is_measured_whole(digits, exact_gns, tmp_path):
    assert_fit_measures_whole(SwinStyle, *digits, exact_gns, tmp_path)


def test_a_swin_style_model_in_timms_layout_is_measured_whole(digits, exact_gns, tmp_path):
    """q, k and v from one Linear, ``permute(2, 0, 3, 1, 4).unbind(0)`` (timm's ``WindowAttention``): before, the
    rows' move to dim 1 ended the walk and the fit was not measured."""
    assert_fit_measures_whole(partial(SwinStyle, attention=FusedWindowAttention), *digits, exact_gns, tmp_path)
