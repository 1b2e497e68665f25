import math

import pytest

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg  # noqa: E402

from gns_callback import plots  # noqa: E402
from tests.recommendation.synthetic import synthetic_estimate, synthetic_history, synthetic_probe, synthetic_report  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path):
    assert path.exists() and path.read_bytes()[:8] == PNG_SIGNATURE
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 400 and image.shape[2] in (3, 4)
    assert image.std() > 0.01  # not blank


def test_render_report_writes_all_three_pngs(tmp_path):
    written = plots.render_report(synthetic_report(), tmp_path)
    assert set(written) == {"history", "tradeoff", "probe"}
    assert written["history"].name == plots.HISTORY_PNG
    for path in written.values():
        assert_png(path)


def test_missing_sections_are_skipped(tmp_path):
    assert plots.render_report({"report_version": 1}, tmp_path) == {}
    only_estimate = {"estimate": synthetic_estimate()}
    assert set(plots.render_report(only_estimate, tmp_path / "a")) == {"tradeoff"}
    unmeasured = {"estimate": synthetic_estimate(b=None, lo=None, hi=None, steps=0), "history": []}
    assert plots.render_report(unmeasured, tmp_path / "b") == {}
    assert plots.plot_history([]) is None
    assert plots.plot_history([{"step": 1, "b_simple": None, "ci_low": None, "ci_high": None}]) is None
    assert plots.plot_tradeoff(math.nan) is None and plots.plot_tradeoff(math.inf) is None
    assert plots.plot_probe(None) is None and plots.plot_probe({"trials": []}) is None


def test_plots_cope_with_unbounded_intervals_and_partial_probe(tmp_path):
    fig = plots.plot_tradeoff(300.0, 120.0, math.inf, current_batch_size=32, path=tmp_path / "t.png")
    assert fig is not None
    assert_png(tmp_path / "t.png")
    history = synthetic_history(5)
    history[2]["ci_low"] = 0.0
    assert plots.plot_history(history, path=tmp_path / "h.png") is not None
    assert_png(tmp_path / "h.png")
    # Throughput only (no memory fit), and memory only (no throughput).
    probe = synthetic_probe()
    thr_only = {"max_micro_batch": 128, "throughput": probe["throughput"], "trials": []}
    mem_only = {**probe, "throughput": [], "trials": [{**t, "samples_per_s": None} for t in probe["trials"]]}
    fig = plots.plot_probe(thr_only)
    assert fig is not None and fig.axes[0].texts[0].get_text() == "no memory measured"
    fig = plots.plot_probe(mem_only)
    assert fig is not None and fig.axes[1].texts[0].get_text() == "no throughput measured"


def test_figures_have_log_axes_and_labels():
    report = synthetic_report()
    fig = plots.plot_history(report["history"], current_batch_size=16, recommended_batch_size=80)
    (ax,) = fig.axes
    assert ax.get_yscale() == "log" and ax.get_xlabel() == "optimizer step" and ax.get_legend() is not None
    fig = plots.plot_tradeoff(76.4, 62.5, 98.0, current_batch_size=16, recommended_batch_size=80)
    left, right = fig.axes
    assert left.get_xscale() == left.get_yscale() == "log" and "E/E_min" in left.get_xlabel()
    assert right.get_xscale() == "log" and "batch" in right.get_xlabel()
