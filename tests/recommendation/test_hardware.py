from gns_callback.recommendation.hardware import read_hardware
from tests.recommendation.synthetic import synthetic_probe


def test_cap_from_probe_explicit_arguments_or_current_micro():
    hw = read_hardware(synthetic_probe(), None, None, 16)
    assert hw.micro_cap == 128 and len(hw.throughput) == 5 and "fastest measured" in hw.notes[0]
    hw = read_hardware(synthetic_probe(), 32, {}, 16)  # explicit arguments override the probe
    assert hw.micro_cap == 32 and hw.throughput == {}
    hw = read_hardware(None, None, None, 16)
    assert hw.micro_cap == 16 and hw.notes == ("micro-batch: current micro-batch (16; no probe)",)
    assert read_hardware(None, None, None, None).micro_cap is None


def test_cap_never_above_the_memory_limit_and_nothing_fits_is_ignored():
    assert read_hardware(None, 50, {64: 900.0, 32: 500.0}, None).micro_cap == 32
    hw = read_hardware({"max_micro_batch": 0, "trials": []}, None, None, 8)
    assert hw.micro_cap == 8 and "no micro-batch that fits" in hw.notes[0]
