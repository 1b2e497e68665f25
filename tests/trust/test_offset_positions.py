"""A position table looked up at ``arange(T) + 2`` with as many positions as the batch has examples, in a real fit at
the defaults. Before, its indices were taken for the examples' own (only ``arange(T)`` itself was known as shared
positions): each example's norm held the whole batch's gradient of the position rows. The first batch's check caught
it here, as examples "coupled" by 0.3%, and nothing was measured; a framework-free tracker without that check read
wrong per-example norms."""

from tests.trust.models import OffsetPositions
from tests.trust.setups import assert_fit_measures_whole


def test_a_position_table_at_an_offset_is_read_where_it_meets_the_examples(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(OffsetPositions, (x * 16).round().long(), y, exact_gns, tmp_path)
