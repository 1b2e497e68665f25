"""Rows flattened from the examples' positions (``h.view(B·T, D)`` into a Linear, a GELU, a LayerNorm and a second
Linear), in a real fit at the defaults. Before, the first such layer stopped the measurement at the first step (its
rows hold no batch of the batch's size): B_simple not measured."""

import torch

from benchmarks.model_scan import FlattenedRows
from tests.trust.setups import assert_fit_measures_whole


def seeded() -> FlattenedRows:
    torch.manual_seed(0)
    return FlattenedRows()


def test_rows_flattened_from_the_examples_are_measured_whole(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(seeded, (x * 16).round().long(), y, exact_gns, tmp_path)
