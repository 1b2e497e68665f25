from gns_callback.recommendation.current import read_current


def test_current_split_given_derived_or_unknown():
    assert read_current(64, 1, 16, 4) == read_current(64, 1, 16, None)
    assert read_current(64, 1, None, 4).micro_batch_size == 16
    assert read_current(128, 2, None, 2).micro_batch_size == 32
    # Accumulation that does not divide: the micro-batch falls back to the per-device share.
    assert (read_current(100, 1, None, 3).micro_batch_size, read_current(100, 1, None, 3).accumulate) == (100, 3)
    # A batch that does not divide over the devices: unknown micro-batch and accumulation.
    unknown = read_current(10, 3, None, None)
    assert unknown.micro_batch_size is None and unknown.accumulate is None
