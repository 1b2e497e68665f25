import math

from gns_callback.recommendation.batch import Grid, aim, batch_bounds, keep, nearest_splitting
from gns_callback.recommendation.current import read_current


def test_bounds_from_arguments_and_dataset():
    b = batch_bounds(None, None, None)
    assert (b.lo, b.hi, b.notes) == (1, math.inf, ())
    b = batch_bounds(16, 4096, 1000)
    assert (b.lo, b.hi, b.hi_is_dataset) == (16, 1000, True)
    b = batch_bounds(512, 128, None)
    assert (b.lo, b.hi) == (128, 128) and "above the upper bound" in b.notes[0]


def test_aim_rounds_clips_and_splits():
    current = read_current(8, 1, None, None)
    c = aim(205.0, batch_bounds(None, None, None), Grid(8), current, 64)
    assert (c.target, c.batch_size, c.micro_batch_size, c.accumulate) == (205.0, 208, 52, 4)
    c = aim(1000.0, batch_bounds(None, None, 100), Grid(8), current, None)
    assert c.batch_size == 96 and "data-set size" in c.notes[0]


def test_keep_resplits_the_current_batch_under_the_cap():
    current = read_current(128, 1, 16, 8)
    c = keep(batch_bounds(None, None, None), current, 64)
    assert (c.batch_size, c.micro_batch_size, c.accumulate) == (128, 64, 2)
    assert "micro-batch 16 → 64" in c.notes[-1]
    # A batch that does not divide over the devices: the nearest one that does.
    c = keep(batch_bounds(None, None, None), read_current(10, 3, None, None), None)
    assert c.batch_size in (9, 12) and c.micro_batch_size * c.accumulate * 3 == c.batch_size


def test_nearest_splitting_falls_back_to_coarser_grids_with_a_note():
    size, (micro, accum), notes = nearest_splitting(203.0, 1, 1000.0, 3, None, Grid(8, power_of_two=True))
    assert size % 24 == 0 and micro * accum * 3 == size and "power of two" in notes[0]
    assert nearest_splitting(5.0, 1, 2.0, 4, None, Grid(1))[:2] == (4, (1, 1))


def test_bounds_with_no_size_on_the_grid_say_so():
    """``min_batch_size=13, max_batch_size=15, power_of_two=True``: before, the note blamed the devices ("no size in
    range that is a power of two splits over the devices"), on one device."""
    size, _, notes = nearest_splitting(100.0, 13, 15, 1, None, Grid(8, True))
    assert size == 15 and notes == ("no size in [13, 15] (the batch-size bounds) is a power of two: using any size",)
    size, _, notes = nearest_splitting(24.0, 1, 64, 3, 4, Grid(8))
    assert all("bounds" not in note for note in notes)
