import math

import pytest

from gns_callback.estimate import GNSEstimate
from gns_callback.recommendation.trust import EstimateView, assess, read_estimate, verdict
from tests.recommendation.synthetic import synthetic_estimate


def test_read_estimate_from_dict_object_and_none():
    d = synthetic_estimate(b=120.0, lo=100.0, hi=150.0, steps=300)
    for source in (d, GNSEstimate.from_dict(d)):
        view = read_estimate(source)
        assert (view.b_simple, view.ci_low, view.ci_high, view.steps) == (120.0, 100.0, 150.0, 300)
        assert view.averaging == "run" and view.confidence == 0.95
    nothing = read_estimate(None)
    assert math.isnan(nothing.b_simple) and nothing.steps == 0


def test_null_reads_unbounded_after_steps_and_unknown_before():
    assert read_estimate({"b_simple": None, "ci_low": 5.0, "ci_high": None, "steps": 10}).ci_high == math.inf
    view = read_estimate({"b_simple": None, "ci_low": None, "ci_high": None, "steps": 0})
    assert math.isnan(view.b_simple) and math.isnan(view.ci_high)


@pytest.mark.parametrize(
    "args, status",
    [
        ((math.nan, math.nan, math.nan, 0), "no_estimate"),
        ((100.0, 80.0, 120.0, 5), "too_few_steps"),
        ((100.0, 80.0, math.inf, 400), "unbounded"),
        ((100.0, 20.0, 120.0, 400), "too_wide"),  # 120/20 = 6 > 4
        ((100.0, 0.0, 120.0, 400), "too_wide"),
        ((100.0, 50.0, 200.0, 400), "ok"),  # exactly 4: trusted
        ((100.0, 50.0, 200.0, None), "ok"),  # steps not given: not checked
    ],
)
def test_assess_statuses(args, status):
    assert assess(*args)[0] == status


def test_verdict_keeps_a_batch_inside_a_trusted_interval():
    view = EstimateView(70.0, 55.0, 90.0, 400)
    assert verdict(view, 64)[0] == "within_interval"
    assert verdict(view, 64, keep_within_interval=False)[0] == "ok"
    assert verdict(view, 32)[0] == "ok"
    assert verdict(EstimateView(70.0, 55.0, math.inf, 400), 64)[0] == "unbounded"


def test_an_estimate_that_stopped_measuring_reads_not_measured_from_json_not_unbounded():
    """JSON writes "not measured" and "unbounded" alike as null. Before, the report command recomputing from a run
    that stopped measuring (null b_simple after 20 steps) read B_simple = ∞ and said "unbounded: |G|² not resolved
    from the noise"."""
    stopped = {"b_simple": None, "ci_low": None, "ci_high": None, "steps": 20, "failure": "hooks stopped"}
    target = {"b_simple": None, "ci_low": None, "ci_high": None, "steps": 20}  # the report's batch_target
    for data in (stopped, target):
        view = read_estimate(data)
        assert math.isnan(view.b_simple) and math.isnan(view.ci_high)
        assert assess(view.b_simple, view.ci_low, view.ci_high, view.steps)[0] == "no_estimate"
