"""RWKV's token shift, ``x·μ + x_prev·(1 − μ)``, in a real fit at the defaults. Before, ``μ`` was left out (its use
through ``1 − μ`` was not read)."""

from tests.trust.models import TimeMix
from tests.trust.setups import assert_fit_measures_whole


def test_a_time_mix_is_measured_whole(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(TimeMix, (x * 16).round().long(), y, exact_gns, tmp_path)
