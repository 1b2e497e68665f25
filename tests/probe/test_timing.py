"""Repeated timing: the median's interval covers the true median as often as it claims, the spread and the
medians are what the definitions say, and sizes are ranked only beyond the noise. Then the probe itself:
round-robin timing, its stopping rules, cost reported, and an OOM while timed."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from gns_callback.probe import ProbeResult, probe_micro_batch
from gns_callback.probe.timing import Timing, faster, median_interval, precise_enough, summarize
from tests.helpers import mlp


# ---------------------------------------------------------------------------------------------- pure
def test_median_interval_needs_six_repeats_and_then_brackets_by_order_statistics():
    assert median_interval([1.0] * 5) is None
    assert median_interval([5, 1, 4, 2, 6, 3]) == (1, 6)  # n = 6: [min, max], coverage 1 − 2/64
    assert median_interval(list(range(100))) == (39, 60)  # k = 40: the textbook interval for n = 100


@pytest.mark.parametrize("n", [6, 15, 40])
def test_median_interval_covers_the_true_median_at_least_95_percent_of_the_time(n):
    rng = random.Random(n)
    runs, true_median = 3000, math.log(2)  # exponential(1): skewed like step times
    hits = 0
    for _ in range(runs):
        low, high = median_interval([rng.expovariate(1.0) for _ in range(n)])
        hits += low <= true_median <= high
    standard_error = math.sqrt(0.95 * 0.05 / runs)
    assert hits / runs >= 0.95 - 3 * standard_error


def test_summarize_medians_spread_and_interval():
    step = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    optimizer = [0.5] * 7
    timing = summarize(step, optimizer)
    assert timing.repeats == 7 and timing.seconds == 4.5  # median of the paired totals
    assert timing.step_seconds == 4.0 and timing.optimizer_seconds == 0.5
    assert timing.spread == pytest.approx((6.0 - 3.0) / 4.5)  # inclusive quartiles of the totals
    assert (timing.seconds_low, timing.seconds_high) == (1.5, 7.5)
    assert timing.rel_halfwidth == pytest.approx(3.0 / 4.5)
    with pytest.raises(ValueError):
        summarize([], [])


def timing(seconds, halfwidth, repeats=20):
    return Timing(repeats, seconds, seconds * (1 - halfwidth), seconds * (1 + halfwidth), 0.1, seconds, 0.0)


def test_faster_decides_only_beyond_the_noise():
    assert faster(200, timing(1.0, 0.05), 100, timing(1.0, 0.05)) is True  # 200 vs 100 samples/s, ±5%
    assert faster(100, timing(1.0, 0.05), 200, timing(1.0, 0.05)) is False
    assert faster(105, timing(1.0, 0.05), 100, timing(1.0, 0.05)) is None  # 5% apart inside ±5%
    assert faster(200, Timing.single(1.0), 100, timing(1.0, 0.05)) is None  # one repeat: no interval
    assert precise_enough(timing(1.0, 0.029), 0.03) and not precise_enough(timing(1.0, 0.05), 0.03)
    assert not precise_enough(Timing.single(1.0), 0.5)


def result_with(timings):
    return ProbeResult(max(timings), None, None, 10**9, 0.85, "cpu", "accounting", timings=timings)


def test_fastest_micro_batch_prefers_the_larger_size_within_the_noise():
    # 128: 1000 samples/s ± 10%; 256: 1050 ± 10% (not distinguishable); 64: 600 ± 2% (clearly slower)
    timings = {64: timing(64 / 600, 0.02), 128: timing(128 / 1000, 0.1), 256: timing(256 / 1050, 0.1)}
    result = result_with(timings)
    assert result.faster(256, 128) is None and result.faster(128, 64) is True
    assert result.fastest_micro_batch == 256
    noisy_small = result_with({128: timing(128 / 1100, 0.01), 256: timing(256 / 1000, 0.01)})
    assert noisy_small.fastest_micro_batch == 128  # 10% faster beyond ±1%: the smaller size wins
    with pytest.raises(ValueError, match="512 was not timed"):
        result.faster(512, 64)


def test_timings_round_trip_and_old_rows_still_load():
    result = result_with({64: timing(0.1, 0.05), 128: Timing.single(0.2, 0.01)})
    assert ProbeResult.from_dict(result.to_dict()) == result
    old = result.to_dict() | {"throughput": [{"size": 64, "samples_per_s": 640.0}]}
    assert ProbeResult.from_dict(old).throughput == {64: pytest.approx(640.0)}


# ---------------------------------------------------------------------------------------------- the probe
def probe_with(step_log, **kwargs):
    net = mlp()
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))

    def step(b):
        step_log.append(b[0].shape[0])
        return F.cross_entropy(net(b[0]), b[1])

    settings = dict(memory_budget_bytes=10**8, max_batch_size=64, throughput_sizes=[16, 32], progress_bar=False)
    return probe_micro_batch(net, torch.optim.SGD(net.parameters(), lr=0.1), batch, step, **{**settings, **kwargs})


def test_sizes_are_timed_round_robin_and_the_cost_is_reported():
    log = []
    result = probe_with(log, timing_budget_s=0.0, timed_steps=6)
    timed = log[-3 * 6:]  # the last 18 steps: 6 rounds over the 3 sizes
    assert timed == [16, 32, 64] * 6
    assert {s: t.repeats for s, t in result.timings.items()} == {16: 6, 32: 6, 64: 6}
    assert all(t.seconds_low <= t.seconds <= t.seconds_high for t in result.timings.values())
    assert 0 < result.timing_seconds < result.wall_seconds


def test_timing_stops_at_the_cap_when_neither_precision_nor_budget_stops_it():
    result = probe_with([], timing_budget_s=1e6, timing_precision=1e-9, max_timed_steps=9, timed_steps=6)
    assert {t.repeats for t in result.timings.values()} == {9}


def test_an_oom_while_timed_drops_that_size_only():
    calls = {"n": 0}
    log = []
    net = mlp()

    def step(b):
        log.append(b[0].shape[0])
        if b[0].shape[0] == 32 and log.count(32) == 4:  # its confirmation and 2 timed steps ran
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        calls["n"] += 1
        return F.cross_entropy(net(b[0]), b[1])

    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    result = probe_micro_batch(net, None, batch, step, memory_budget_bytes=10**8, max_batch_size=64,
                               throughput_sizes=[16, 32], timing_budget_s=0.0, progress_bar=False)
    assert set(result.timings) == {16, 64} and result.max_micro_batch == 64
    failed = [t for t in result.trials if t.size == 32 and t.phase == "throughput"]
    assert failed and not failed[0].ok and failed[0].error == "out of memory while timed"


class FakeClock:
    """``perf_counter`` that advances ``tick`` seconds per call: steps take exactly the same time."""

    def __init__(self, tick=0.001):
        self.now, self.tick = 0.0, tick

    def perf_counter(self):
        self.now += self.tick
        return self.now


def test_a_precise_timing_still_runs_half_the_budget_then_stops(monkeypatch):
    import gns_callback.probe.trial as trial_module

    clock = FakeClock()
    monkeypatch.setattr(trial_module, "time", clock)
    result = probe_with([], timing_budget_s=1.0, timed_steps=6)
    repeats = {t.repeats for t in result.timings.values()}
    assert len(repeats) == 1  # every size in every round
    (n,) = repeats
    # identical steps: precise from the start, yet timed over at least half the budget (3 sizes × 3 clock
    # readings per step + 1 per round = 10 ms a round), and stopped well before its end
    assert 0.5 / 0.010 <= n <= 0.5 / 0.010 + 2
    assert all(t.rel_halfwidth == 0.0 for t in result.timings.values())
