"""The objectives' maths against closed forms and exhaustive searches (gns_callback/recommendation/objective.py)."""

import json
import math

import pytest
import torch

from gns_callback.recommendation import Recommendation, recommend
from gns_callback.recommendation.batch import Bounds, Grid
from gns_callback.recommendation.objective import (
    COST,
    KEPT,
    NOT_MEASURED,
    OK,
    TIME,
    Config,
    Search,
    StepTimes,
    best,
    device_counts,
    device_time,
    examples_ratio,
    optimise,
    steps_ratio,
    wall_time,
)
from gns_callback.recommendation.sizing import split
from tests.recommendation.synthetic import synthetic_estimate

T0, C = 0.01, 1e-4  # step time t(m) = t0 + c·m seconds: a 10 ms overhead, 0.1 ms per example


def affine_table(t0=T0, c=C, sizes=(8, 4096)) -> dict[int, float]:
    """``{m: samples/s}`` for ``t(m) = t0 + c·m``: two sizes define it (the interpolation is linear in time)."""
    return {m: m / (t0 + c * m) for m in sizes}


def estimate(b, ratio=1.2):
    return synthetic_estimate(b=b, lo=b / ratio, hi=b * ratio, steps=1000)


def rec(b, objective, *, current=64, table=None, **kw):
    kw.setdefault("max_micro_batch", 4096)
    return recommend(estimate(b), current_batch_size=current, current_lr=0.1, optimizer=torch.optim.SGD,
                     throughput=affine_table() if table is None else table, objective=objective, **kw)


def grid_argmin(value, sizes):
    return min(sizes, key=value)


# --- the model ------------------------------------------------------------------------------------------------
def test_step_times_are_exact_for_an_affine_step_time_between_measured_sizes():
    times = StepTimes(affine_table())
    for m in (8, 9, 100, 1000, 4096):
        assert times.seconds(m) == pytest.approx(T0 + C * m, rel=1e-12)
    assert times.seconds(4) == pytest.approx(T0 + 8 * C)  # below: constant
    assert times.seconds(8192) == pytest.approx(2 * (T0 + 4096 * C))  # above: flat throughput


def test_ratios_closed_form_and_limits():
    assert steps_ratio(200, 100, 100) == pytest.approx((1 + 100 / 200) / (1 + 100 / 100))
    assert examples_ratio(200, 100, 100) == pytest.approx((100 + 200) / (100 + 100))
    assert steps_ratio(400, 100, math.inf) == 0.25 and examples_ratio(400, 100, math.inf) == 1.0
    assert math.isnan(steps_ratio(1, 2, math.nan))


def test_device_hours_are_devices_times_wall_time():
    """C = D·S·a·t(m) with S = S_min(1 + B_noise/B), E_min = S_min·B_noise: C/E_min = (1 + B/B_noise)·t(m)/m."""
    times, bn = StepTimes(affine_table()), 300.0
    for cfg in (Config(96, 24, 2, 2), Config(64, 64, 1, 1), Config(512, 32, 4, 4)):
        assert device_time(cfg, bn, times) * bn == pytest.approx(cfg.num_devices * wall_time(cfg, bn, times))


# --- "time": closed forms ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("b_noise", [25.0, 100.0, 400.0, 1600.0])
def test_time_optimal_batch_is_sqrt_bnoise_t0_over_c(b_noise):
    """T ∝ (1 + B_noise/B)(t0 + c·B) is least at B = √(B_noise·t0/c) (one device, no accumulation)."""
    r = rec(b_noise, "time")
    optimum = math.sqrt(b_noise * T0 / C)
    exact = grid_argmin(lambda b: (1 + b_noise / b) * (T0 + C * b), range(8, 4097, 8))
    assert r.batch_size == exact and abs(r.batch_size - optimum) <= 8
    assert (r.micro_batch_size, r.accumulate_grad_batches, r.num_devices) == (r.batch_size, 1, 1)
    plan = r.plans[TIME]
    expected = (1 + b_noise / exact) * (T0 + C * exact) / ((1 + b_noise / 64) * (T0 + C * 64))
    assert plan.time.value == pytest.approx(expected, rel=1e-9)
    assert r.time_to_target_ratio == pytest.approx(expected, rel=1e-9)


def test_time_lies_above_the_knee_exactly_when_the_overhead_dominates():
    """√(B_noise·t0/c) > B_noise ⇔ t0/c > B_noise (here t0/c = 100)."""
    above, below = rec(25.0, "time"), rec(1600.0, "time")
    assert above.batch_size > above.plans["balanced"].batch_size
    assert below.batch_size < below.plans["balanced"].batch_size


def test_time_optimal_batch_with_devices():
    """D devices in parallel: T ∝ (1 + B_noise/B)(t0 + c·B/D), least at B = √(B_noise·t0·D/c) = 400 here."""
    r = rec(400.0, "time", current=64, num_devices=4)
    assert (r.batch_size, r.micro_batch_size, r.accumulate_grad_batches, r.num_devices) == (400, 100, 1, 4)


def test_flat_throughput_never_accumulates_on_one_device():
    """t(m) = c·m: T ∝ (1 + B_noise/B)·a·c·m = c·(B + B_noise)·(per example), so the smallest batch is fastest and
    accumulation only adds examples, however large B_noise is."""
    flat = {m: 1000.0 for m in (8, 16, 32, 64)}
    for b_noise in (10.0, 300.0, 1e5):
        r = rec(b_noise, "time", table=flat, max_micro_batch=64)
        assert r.accumulate_grad_batches == 1 and r.num_devices == 1
        assert r.batch_size == 8


def test_past_the_micro_batch_cap_time_stops_instead_of_accumulating():
    """B_noise = 10⁴ puts √(B_noise·t0/c) = 1000 above the memory cap 64: the fastest plan is one full micro-batch."""
    r = rec(1e4, "time", max_micro_batch=64, table=affine_table(sizes=(8, 64, 4096)))
    assert (r.batch_size, r.micro_batch_size, r.accumulate_grad_batches) == (64, 64, 1)


# --- "cost" ----------------------------------------------------------------------------------------------------
def test_cost_equals_time_at_a_fixed_device_count():
    for devices in (1, 4):
        r = rec(400.0, "cost", num_devices=devices)
        assert r.plans[COST].config == r.plans[TIME].config


def test_cost_with_devices_takes_the_fewest_and_time_the_most():
    """max_devices=4: "time" → B = √(B_noise·t0·4/c) = 400 on 4 devices; "cost" → C ∝ (1 + B/B_noise)(t0/m + c),
    least at m = B = √(B_noise·t0/c) = 200 on one device."""
    r = rec(400.0, "cost", num_devices=4, max_devices=4, current=256)
    fast, cheap = r.plans[TIME], r.plans[COST]
    assert (fast.batch_size, fast.micro_batch_size, fast.num_devices) == (400, 100, 4)
    cheap_split = (cheap.batch_size, cheap.micro_batch_size, cheap.num_devices, cheap.accumulate_grad_batches)
    assert cheap_split == (200, 200, 1, 1)
    assert (r.batch_size, r.num_devices) == (200, 1)
    hours = lambda b, m: (1 + b / 400) * (T0 / m + C)  # noqa: E731
    wall = lambda b, m: (1 + 400 / b) * (T0 + C * m)  # noqa: E731
    assert cheap.device_hours.value / fast.device_hours.value == pytest.approx(hours(200, 200) / hours(400, 100))
    assert cheap.time.value / fast.time.value == pytest.approx(wall(200, 200) / wall(400, 100))
    assert any("scale linearly with devices" in n for n in r.notes)


def test_device_counts():
    assert device_counts(2, None) == (2,)
    assert device_counts(3, 8) == (1, 2, 3, 4, 8)
    assert device_counts(16, 6) == (1, 2, 4, 6)


@pytest.mark.parametrize("objective", [TIME, COST])
@pytest.mark.parametrize("b_noise", [30.0, 700.0])
def test_the_scan_finds_the_exhaustive_optimum(objective, b_noise):
    """A measured-looking table (throughput rising, then falling past 256): scan + refine against every grid size
    and every device count."""
    table = {8: 900.0, 16: 1500.0, 32: 2600.0, 64: 3400.0, 128: 3900.0, 256: 4000.0, 512: 3600.0}
    times, grid = StepTimes(table), Grid(8)
    search = Search(Bounds(1, 8192.0, False), grid, 256, device_counts(2, 8))
    found = optimise(objective, search, b_noise, times, Config(64, 32, 1, 2))
    every = [Config(b, *parts, d) for d in search.devices for b in range(8, 8193, 8)
             for parts in [split(b, d, 256) or split(b, d, 256, strict=False)] if parts is not None]
    exhaustive = best(objective, every, b_noise, times)
    value = wall_time if objective == TIME else device_time
    assert value(found, b_noise, times) == pytest.approx(value(exhaustive, b_noise, times), rel=1e-12)


# --- intervals -------------------------------------------------------------------------------------------------
def test_each_prediction_carries_the_b_noise_interval():
    lo, b, hi = 200.0, 400.0, 800.0
    r = recommend(synthetic_estimate(b=b, lo=lo, hi=hi, steps=1000), current_batch_size=64, current_lr=0.1,
                  throughput=affine_table(), max_micro_batch=4096, objective="time")
    plan, size = r.plans[TIME], r.batch_size
    step = (T0 + C * size) / (T0 + C * 64)
    ends_steps = sorted(steps_ratio(size, 64, x) for x in (lo, hi))
    ends_examples = sorted(examples_ratio(size, 64, x) for x in (lo, hi))
    assert (plan.steps.low, plan.steps.high) == pytest.approx(ends_steps)
    assert (plan.examples.low, plan.examples.high) == pytest.approx(ends_examples)
    assert (plan.time.low, plan.time.high) == pytest.approx([e * step for e in ends_steps])
    for ratio in (plan.steps, plan.examples, plan.time):
        assert ratio.low <= ratio.value <= ratio.high


# --- what it needs, and what it keeps --------------------------------------------------------------------------
def test_time_without_any_step_time_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"objective='time'.*probe=.*throughput=.*objective='balanced'"):
        recommend(estimate(200.0), current_batch_size=64, current_lr=0.1, objective="time")
    with pytest.raises(ValueError, match="objective must be one of"):
        recommend(estimate(200.0), current_batch_size=64, current_lr=0.1, objective="fast")
    with pytest.raises(ValueError, match="max_devices"):
        rec(200.0, "cost", max_devices=0)


def test_a_probe_that_measured_nothing_gives_the_balanced_batch_and_says_why():
    probe = {"max_micro_batch": None, "throughput": [], "trials": []}
    r = recommend(estimate(200.0), current_batch_size=64, current_lr=0.1, probe=probe, objective="time")
    assert r.plans[TIME].status == NOT_MEASURED and r.plans[COST].status == NOT_MEASURED
    assert r.batch_size == r.plans["balanced"].batch_size == 200
    assert any("needs the probe's step times" in n for n in r.notes)
    assert "not measured" in r.summary_table()


def test_an_untrusted_estimate_keeps_the_current_batch_for_every_objective():
    r = recommend(synthetic_estimate(b=300.0, lo=10.0, hi=9000.0, steps=1000), current_batch_size=64,
                  current_lr=0.1, throughput=affine_table(), max_micro_batch=4096, objective="time")
    assert r.status == "too_wide" and r.batch_size == 64
    assert r.plans[TIME].status == KEPT and r.plans[TIME].batch_size == 64
    assert r.plans[TIME].time.value == 1.0


def test_within_interval_time_still_moves_when_it_is_faster():
    r = recommend(
        synthetic_estimate(b=60.0, lo=40.0, hi=90.0, steps=1000), current_batch_size=64, current_lr=0.1,
        throughput=affine_table(), max_micro_batch=4096, objective="time")
    assert r.plans["balanced"].batch_size == 64  # the knee keeps a batch inside the interval
    assert r.status == OK and r.batch_size == r.plans[TIME].batch_size > 64
    assert "objective='time'" in r.reason


# --- the report ------------------------------------------------------------------------------------------------
def test_plans_round_trip_through_json_and_old_reports_still_read():
    r = rec(25.0, "time", max_devices=2)
    back = Recommendation.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.objective == TIME and set(back.plans) == {"balanced", "time", "cost"}
    old = r.to_dict()
    del old["plans"], old["objective"]
    legacy = Recommendation.from_dict(old)
    assert legacy.plans == {} and legacy.objective == "balanced"


def test_summary_shows_the_three_objectives_side_by_side():
    text = rec(25.0, "time").summary_table()
    table = text[text.index("Objectives"):]
    header = table.splitlines()[1].split()
    assert header == ["objective", "balanced", "time", "*", "cost"]
    for label in ("global batch", "micro × accumulate × devices", "learning rate", "steps vs current",
                  "examples vs current", "time vs current", "device-hours vs current"):
        assert label in table
    assert "[" in table.splitlines()[5]  # an interval on the steps row
