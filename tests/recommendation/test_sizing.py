from types import SimpleNamespace

from gns_callback.recommendation import candidates, probe_inputs, split
from gns_callback.recommendation.sizing import parse_trial, preferred_micro, split_keeping
from tests.recommendation.synthetic import synthetic_probe


def test_split_exact_and_fewest_accumulation_steps():
    assert split(256, 1, None) == (256, 1)
    assert split(256, 2, 64) == (64, 2)
    assert split(200, 1, 64) == (50, 4)  # ceil(200/64) = 4 equal micro-batches of 50
    assert split(96, 3, 16) == (16, 2)
    assert split(256, 1, 48) is None  # 6 micro-batches of 42.67: does not divide
    assert split(256, 1, 48, strict=False) == (32, 8)  # relaxed: the largest divisor in (24, 48]
    assert split(2048, 1, 48, strict=False) == (32, 64)
    assert split(97, 1, 48, strict=False) is None
    assert split(100, 8, None) is None  # not divisible by the devices
    for g, d, cap in [(264, 1, 48), (4096, 8, 128), (1000, 5, 8)]:
        micro, accum = split(g, d, cap)
        assert micro * accum * d == g and micro <= cap


def test_split_keeping_uses_largest_divisor():
    assert split_keeping(96, 1, 40) == (32, 3)
    assert split_keeping(97, 1, 40) == (1, 97)  # a prime share: the user's batch is kept as is
    assert split_keeping(100, 3, 40) is None


def test_candidates_nearest_first():
    assert list(candidates(100, 1, 1000, 8))[:5] == [104, 96, 112, 88, 120]
    assert list(candidates(203, 1, 1000, 8))[:1] == [200]
    assert list(candidates(5000, 1, 300, 8))[:2] == [296, 288]  # clipped to the bound
    assert list(candidates(100, 1, 1000, 8, power_of_two=True))[:3] == [128, 64, 256]
    assert list(candidates(90, 1, 1000, 8, power_of_two=True))[:1] == [64]  # log distance: 90 is nearer 64
    assert list(candidates(100, 1, 4, 8)) == []


def test_probe_inputs_accepts_tuples_dicts_and_objects():
    trials = [(8, True, 1e6, 500.0), {"size": 16, "ok": True, "bytes": 2e6, "samples_per_sec": 900.0},
              SimpleNamespace(size=32, ok=False, bytes=None, samples_per_sec=None)]
    for probe in ({"max_micro_batch": 24, "trials": trials}, SimpleNamespace(max_micro_batch=24, trials=trials)):
        assert probe_inputs(probe) == (24, {8: 500.0, 16: 900.0})
    assert probe_inputs(None) == (None, {})


def test_probe_inputs_reads_the_probe_result_format():
    probe = synthetic_probe()
    assert probe_inputs(probe) == (128, {8: 750.0, 16: 1200.0, 32: 3000 * 32 / 56, 64: 3000 * 64 / 88,
                                         128: 3000 * 128 / 152})
    # Without the throughput table, from the trials (split-search trials with a split factor are left out).
    no_table = {**probe, "throughput": []}
    no_table["trials"] = probe["trials"] + [{"size": 512, "ok": True, "samples_per_s": 9e9, "split": 4}]
    assert probe_inputs(no_table) == probe_inputs(probe)
    # The object form: ``throughput`` as a dict.
    obj = SimpleNamespace(max_micro_batch=64, throughput={32: 100.0, 64: 150.0}, trials=[])
    assert probe_inputs(obj) == (64, {32: 100.0, 64: 150.0})
    t = parse_trial({"size": 8, "ok": True, "measured_bytes": 5, "samples_per_s": 2.0})
    assert (t.size, t.ok, t.bytes, t.samples_per_sec) == (8, True, 5.0, 2.0)


def test_preferred_micro_is_the_fastest_size_that_fits():
    table = {16: 1000.0, 32: 1800.0, 64: 2500.0, 128: 2400.0, 256: 3000.0}
    assert preferred_micro(200, table, None)[0] == 64  # 256 is faster but does not fit; 128 fits but is slower
    assert preferred_micro(None, table, None)[0] == 256
    assert preferred_micro(100, {}, 8)[0] == 100  # memory limit only
    assert preferred_micro(None, {}, 8)[0] == 8  # current micro-batch
    assert preferred_micro(None, {}, None)[0] is None
    assert preferred_micro(None, {16: 1000.0, 32: 1000.0}, None)[0] == 32  # tie: larger
