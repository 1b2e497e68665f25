import math

import pytest

pytest.importorskip("matplotlib")

from gns_callback.plots import plot_tradeoff  # noqa: E402
from gns_callback.plots.tradeoff import batch_marks  # noqa: E402
from tests.plots.figure_checks import legend_box, legend_labels, texts, tick_labels  # noqa: E402

KEPT_REASON = "the interval is too wide to trust (ci_high/ci_low = 33.3 > 4): keeping the current batch size"


def test_the_quantity_is_called_b_simple_everywhere():
    fig = plot_tradeoff(52.2, 39.9, 72.8, current_batch_size=32, recommended_batch_size=56)
    shown = texts(fig)
    assert not [t for t in shown if "B_noise" in t]
    assert sum("B_simple" in t for t in shown) >= 5  # titles, formulas, knee, the vertical line, the band


def test_kept_batch_is_marked_once_and_the_status_is_shown():
    fig = plot_tradeoff(300.0, 60.0, 2000.0, current_batch_size=64, recommended_batch_size=64, status="too_wide",
                        reason=KEPT_REASON)
    left, right = fig.axes
    assert fig._suptitle is not None
    assert fig._suptitle.get_text().replace("\n", " ") == f"Status: too_wide — {KEPT_REASON}"
    for ax in (left, right):
        mentions = [label for label in legend_labels(ax) if "recommended" in label or "current" in label]
        assert len(mentions) == 1 and "current = recommended B = 64 (kept)" in mentions[0]
    (mark,) = [ln for ln in left.get_lines() if ln.get_marker() == "D"]
    u = 64 / 300.0
    assert (mark.get_xdata()[0], mark.get_ydata()[0]) == pytest.approx((1 + u, 1 + 1 / u))
    assert [ln.get_xdata()[0] for ln in right.get_lines() if "kept" in ln.get_label()] == [64]


def test_changed_batch_marks_both_on_the_curve():
    fig = plot_tradeoff(52.2, 39.9, 72.8, current_batch_size=32, recommended_batch_size=56, status="ok",
                        reason="resolved")
    left, _ = fig.axes
    for marker, batch in (("D", 32), ("*", 56)):
        (mark,) = [ln for ln in left.get_lines() if ln.get_marker() == marker]
        u = batch / 52.2
        assert (mark.get_xdata()[0], mark.get_ydata()[0]) == pytest.approx((1 + u, 1 + 1 / u))
    assert [m.label for m in batch_marks(32, 56)] == ["current B = 32", "recommended B = 56"]


def test_a_batch_far_from_b_simple_stays_in_view():
    """B_simple ≈ 5,900 at batch 64 (the recorded synthetic CIFAR run): S/S_min = 93 at the current batch."""
    left, _ = plot_tradeoff(5900.0, 2900.0, 420000.0, current_batch_size=64).axes
    (mark,) = [ln for ln in left.get_lines() if ln.get_marker() == "D"]
    assert mark.get_ydata()[0] == pytest.approx(1 + 5900 / 64)
    assert left.get_ylim()[1] > mark.get_ydata()[0]


def test_legends_sit_outside_the_panels_and_ticks_are_plain():
    fig = plot_tradeoff(300.0, 60.0, 2000.0, current_batch_size=64, recommended_batch_size=64)
    for ax in fig.axes:
        box, panel = legend_box(fig, ax), ax.get_window_extent()
        assert box.y1 < panel.y0  # under the panel
    labels = tick_labels(fig)
    assert labels and not [t for t in labels if "times" in t or "$" in t or "e+" in t]
    assert not [t for t in texts(fig) if "e+" in t]  # B≈1200 and B≈2400, not 1.2e+03


def test_axes_are_log_and_labelled():
    left, right = plot_tradeoff(76.4, 62.5, 98.0, current_batch_size=16, recommended_batch_size=80).axes
    assert left.get_xscale() == left.get_yscale() == "log" and "E/E_min" in left.get_xlabel()
    assert "S/S_min" in left.get_ylabel()
    assert right.get_xscale() == "log" and right.get_xlabel() == "global batch size B"


def test_no_figure_without_a_finite_b_simple_and_unbounded_intervals_are_said():
    assert plot_tradeoff(math.nan) is None and plot_tradeoff(math.inf) is None and plot_tradeoff(0.0) is None
    _, right = plot_tradeoff(300.0, 120.0, math.inf, current_batch_size=32).axes
    assert "unbounded" in right.get_title()
