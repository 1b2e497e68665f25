import math

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from gns_callback.plots import plot_history  # noqa: E402
from tests.plots.figure_checks import (  # noqa: E402
    data_points,
    labelled_line,
    legend_labels,
    points_under_legend,
    tick_labels,
)
from tests.report_sections import history as make_history  # noqa: E402


def test_legend_covers_no_data_point_and_least_of_all_the_last_ones(history):
    fig = plot_history(history, current_batch_size=32, recommended_batch_size=96)
    (ax,) = fig.axes
    assert points_under_legend(fig, ax) == 0
    last = ax.transData.transform([(history[-1]["step"], history[-1]["b_simple"]),
                                   (history[-1]["step"], history[-1]["b_simple_run"])])
    assert points_under_legend(fig, ax, last) == 0
    assert len(data_points(ax)) > 2 * len(history)  # the check saw the lines and the band


def test_the_old_lower_right_legend_would_have_been_caught():
    """The check finds the overlap of the old layout: B_simple falling to the bottom right (as in the demo run)
    under a legend inside the axes, lower right."""
    rows = [{"step": s, "b_simple": 160 * 0.93**i, "ci_low": 100 * 0.93**i, "ci_high": 600 * 0.93**i,
             "b_simple_run": 150 * 0.95**i} for i, s in enumerate(range(10, 240, 10))]
    fig = plot_history(rows, current_batch_size=32, recommended_batch_size=56)
    (ax,) = fig.axes
    assert points_under_legend(fig, ax) == 0
    ax.legend(loc="lower right", fontsize=8)
    assert points_under_legend(fig, ax) > 0


def test_fit_end_entry_is_marked(history):
    fig = plot_history(history)
    (ax,) = fig.axes
    final = history[-1]["step"]
    line = labelled_line(ax, "fit end")
    assert line.get_label() == f"fit end (step {final})" and list(line.get_xdata()) == [final, final]
    squares = [ln for ln in ax.get_lines() if ln.get_marker() == "s"]
    assert sorted(ln.get_ydata()[0] for ln in squares) == sorted([history[-1]["b_simple"], history[-1]["b_simple_run"]])
    assert all(ln.get_xdata()[0] == final for ln in squares)
    assert any(label.startswith("fit end") for label in legend_labels(ax))


def test_without_a_final_entry_nothing_is_marked_and_every_entry_is_drawn():
    rows = make_history(final=False)
    fig = plot_history(rows)
    (ax,) = fig.axes
    assert not [ln for ln in ax.get_lines() if ln.get_label().startswith("fit end")]
    recent = labelled_line(ax, "B_simple (recent")
    assert list(recent.get_xdata()) == [r["step"] for r in rows]


def test_tick_labels_are_plain_numbers_within_a_decade():
    """B_simple between 25 and 45: matplotlib's own log labels would read '3 × 10¹'."""
    rows = [{"step": s, "b_simple": 25 + s / 5, "ci_low": 20 + s / 5, "ci_high": 30 + s / 5} for s in range(0, 60, 5)]
    labels = tick_labels(plot_history(rows))
    assert labels and not [t for t in labels if "times" in t or "×" in t or "$" in t or "^" in t]
    numbers = [float(t.replace(",", "")) for t in labels if t.replace(",", "").replace(".", "").isdigit()]
    assert len([v for v in numbers if 10 < v < 100]) >= 3  # the y axis got at least three plain labels


def test_matplotlib_default_would_have_written_powers_of_ten():
    """The check above can fail: a default log axis over the same range labels its ticks in × 10ⁿ form."""
    fig = Figure()
    ax = fig.add_subplot()
    ax.plot([0, 1], [18, 48])
    ax.set_yscale("log")
    assert any("times" in t for t in tick_labels(fig))


def test_axis_labels_and_log_scale(history):
    (ax,) = plot_history(history).axes
    assert ax.get_yscale() == "log"
    assert ax.get_xlabel() == "optimizer step" and ax.get_ylabel() == "B_simple (examples)"


def test_kept_batch_is_one_line_that_names_the_status(history):
    (ax,) = plot_history(history, current_batch_size=64, recommended_batch_size=64, status="too_wide").axes
    batch_lines = [ln for ln in ax.get_lines() if "batch" in ln.get_label()]
    assert [ln.get_label() for ln in batch_lines] == ["current batch 64 = recommended (kept: status too_wide)"]
    (ax,) = plot_history(history, current_batch_size=32, recommended_batch_size=96).axes
    labels = [ln.get_label() for ln in ax.get_lines() if "batch" in ln.get_label()]
    assert labels == ["current batch 32", "recommended batch 96"]


def test_unbounded_interval_is_cut_at_the_top_and_said(history):
    (ax,) = plot_history(history).axes
    band = ax.collections[0]
    assert "cut at the top where unbounded" in band.get_label()
    top = ax.get_ylim()[1]
    assert math.isclose(max(v[1] for p in band.get_paths() for v in p.vertices), top)


def test_nothing_drawable_gives_no_figure():
    assert plot_history([]) is None
    assert plot_history([{"step": 1, "b_simple": None, "ci_low": None, "ci_high": None}]) is None
    assert plot_history([{"step": 1, "b_simple": None, "ci_low": None, "ci_high": None}], current_batch_size=8) is None


def test_entries_not_measured_are_a_grey_span_not_an_unbounded_interval():
    """A run that stopped measuring at step 35 logs null values from step 40 on. Before, their null upper ends read
    as unbounded: the band ran from the bottom of the plot to its top, "cut at the top where unbounded"."""
    measured = [{"step": s, "b_simple": 100.0, "ci_low": 80.0, "ci_high": 130.0, "b_simple_run": 100.0}
                for s in (10, 20, 30)]
    stopped = [{"step": s, "b_simple": None, "ci_low": None, "ci_high": None, "b_simple_run": None}
               for s in (40, 50, 114)]
    (ax,) = plot_history(measured + stopped).axes
    band = ax.collections[0]
    assert "unbounded" not in band.get_label()
    xs_at_top = [v[0] for p in band.get_paths() for v in p.vertices if math.isclose(v[1], ax.get_ylim()[1])]
    assert not xs_at_top and max(v[0] for p in band.get_paths() for v in p.vertices) <= 30
    (span,) = [p for p in ax.patches if p.get_label().startswith("not measured")]
    assert span.get_x() == 30 and span.get_x() + span.get_width() == 114
