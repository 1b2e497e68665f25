from gns_callback.recommendation.current import read_current
from gns_callback.recommendation.hardware import fit_advice, read_hardware
from tests.recommendation.synthetic import synthetic_probe

NO_ACCUMULATION = read_current(16, 1, 16, 1)
ACCUMULATING = read_current(64, 1, 16, 4)


def test_cap_from_probe_or_explicit_arguments():
    hw = read_hardware(synthetic_probe(), None, None, NO_ACCUMULATION)
    assert hw.micro_cap == 128 and len(hw.throughput) == 5 and "fastest measured" in hw.notes[0] and hw.measured
    hw = read_hardware(synthetic_probe(), 32, {}, NO_ACCUMULATION)  # explicit arguments override the probe
    assert hw.micro_cap == 32 and hw.throughput == {}


def test_without_a_measurement_accumulate_only_if_the_user_already_does():
    hw = read_hardware(None, None, None, NO_ACCUMULATION)
    assert hw.micro_cap is None and not hw.measured and "no accumulation" in hw.notes[0]
    hw = read_hardware(None, None, None, ACCUMULATING)
    assert hw.micro_cap == 16 and "you accumulate 4" in hw.notes[0]
    assert read_hardware(None, None, None, read_current(10, 3, None, None)).micro_cap is None


def test_cap_never_above_the_memory_limit_and_nothing_fits_is_ignored():
    assert read_hardware(None, 50, {64: 900.0, 32: 500.0}, NO_ACCUMULATION).micro_cap == 32
    hw = read_hardware({"max_micro_batch": 0, "trials": []}, None, None, read_current(8, 1, 8, 1))
    assert hw.micro_cap == 8 and "no micro-batch that fits" in hw.notes[0]


def test_fit_advice_says_how_to_find_out_and_what_to_fall_back_to():
    hw = read_hardware(None, None, None, read_current(24, 1, 24, 1))
    (note,) = fit_advice(hw, read_current(24, 1, 24, 1), 72, 72)
    assert "grows from 24 to 72" in note and "probe=True" in note and "micro-batch 24 × accumulate 3" in note
    (note,) = fit_advice(hw, read_current(24, 1, 24, 1), 97, 97)  # a prime: no good split under 24
    assert "max_micro_batch=24" in note
    assert fit_advice(hw, read_current(24, 1, 24, 1), 16, 16) == ()  # smaller: known to fit
    measured = read_hardware(None, 64, None, NO_ACCUMULATION)
    assert fit_advice(measured, NO_ACCUMULATION, 64, 64) == ()
