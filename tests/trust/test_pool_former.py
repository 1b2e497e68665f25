"""PoolFormer's layout in a real fit at the defaults: a GroupNorm subclass that only changes how it is built, and
layer scales taken channels-first through ``unsqueeze(-1)``. Before, the subclass was left out, and the second
``unsqueeze(-1)`` was read at dim 0 (torch saves a negative dim as its unsigned 64-bit value), so the first backward
raised inside the user's ``loss.backward()`` and ended the run."""

from tests.trust.models import PoolFormerStyle
from tests.trust.setups import assert_fit_measures_whole


def test_a_pool_former_is_measured_whole(digits, exact_gns, tmp_path):
    assert_fit_measures_whole(PoolFormerStyle, *digits, exact_gns, tmp_path)
