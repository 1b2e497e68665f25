import math

import pytest

pytest.importorskip("matplotlib")

import torch  # noqa: E402

from gns_callback.plots import OBJECTIVES_PNG, plot_objectives, render_report  # noqa: E402
from gns_callback.recommendation import recommend  # noqa: E402
from gns_callback.recommendation.objective import StepTimes  # noqa: E402
from tests.plots.figure_checks import legend_labels, texts  # noqa: E402
from tests.recommendation.synthetic import synthetic_estimate  # noqa: E402

T0, C = 0.01, 1e-4


def probe(sizes=(8, 64, 512)):
    """A probe section whose step time is t(m) = t0 + c·m, memory cap 512."""
    rows = [{"size": m, "samples_per_s": m / (T0 + C * m)} for m in sizes]
    return {"max_micro_batch": 512, "throughput": rows, "trials": []}


def rec(objective="time", b=25.0):
    return recommend(synthetic_estimate(b=b, lo=b / 1.3, hi=b * 1.3, steps=1000), current_batch_size=32,
                     current_lr=0.1, optimizer=torch.optim.SGD, probe=probe(), objective=objective)


def marker(ax, prefix):
    (line,) = [ln for ln in ax.get_lines() if ln.get_label().startswith(prefix)]
    return line.get_xdata()[0], line.get_ydata()[0]


def test_three_objectives_are_marked_at_their_predictions():
    r = rec()
    left, right = plot_objectives(r, probe()).axes
    for name in ("balanced", "time", "cost"):
        plan = r.plans[name]
        assert marker(left, f"{name}: B = {plan.batch_size}") == pytest.approx((plan.batch_size, plan.time.value))
        assert marker(right, f"{name}: B = ") == pytest.approx((plan.batch_size, plan.examples.value))
    assert any("(recommended)" in label and label.startswith("time") for label in legend_labels(left))
    assert marker(left, "current B = 32") == (32, 1.0)


def test_the_time_curve_is_the_closed_form_and_its_minimum_is_the_time_plan():
    r = rec()
    left, _ = plot_objectives(r, probe()).axes
    (curve,) = [ln for ln in left.get_lines() if ln.get_label().startswith("at B_simple")]
    xs, ys = curve.get_xdata(), curve.get_ydata()
    reference = (1 + 25 / 32) * (T0 + C * 32)
    for x, y in list(zip(xs, ys))[::37]:
        assert y == pytest.approx((1 + 25 / x) * StepTimes({m: m / (T0 + C * m) for m in (8, 64, 512)}).seconds(x)
                                  / reference, rel=1e-9)
    assert xs[ys.argmin()] == pytest.approx(math.sqrt(25 * T0 / C), rel=0.05)  # √(B_noise·t0/c) = 50
    assert abs(r.plans["time"].batch_size - 50) <= 8


def test_no_figure_without_plans_or_step_times_and_render_writes_it(tmp_path):
    r = rec()
    assert plot_objectives(r, {"max_micro_batch": None, "throughput": [], "trials": []}) is None
    assert "Objective: time" in texts(plot_objectives(r, probe()))[0]
    report = {"recommendation": r.to_dict(), "probe": probe(), "run_estimate": synthetic_estimate()}
    written = render_report(report, tmp_path)
    assert written["objectives"] == tmp_path / OBJECTIVES_PNG and written["objectives"].exists()
