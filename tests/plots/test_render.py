import pytest
import torch

pytest.importorskip("matplotlib")
import matplotlib.image as mpimg  # noqa: E402

from gns_callback import plots  # noqa: E402
from gns_callback.recommendation import recommend  # noqa: E402
from tests.plots.figure_checks import PNG_SIGNATURE  # noqa: E402
from tests.report_sections import estimate  # noqa: E402


@pytest.fixture
def report(history, gpu_probe) -> dict:
    rec = recommend(estimate(), current_batch_size=16, current_lr=0.1, optimizer=torch.optim.SGD,
                    current_accumulate=2, dataset_size=1797, probe=gpu_probe)
    return {"report_version": 1, "estimate": estimate(110.0, 80.0, 160.0, averaging="ema"),
            "run_estimate": estimate(), "history": history, "probe": gpu_probe, "recommendation": rec.to_dict(),
            "run": {"world_size": 1, "accumulate_grad_batches": 2}}


def assert_png(path):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
    assert image.std() > 0.01  # not blank


def test_all_four_pngs(report, tmp_path):
    written = plots.render_report(report, tmp_path)
    assert written == {"history": tmp_path / plots.HISTORY_PNG, "tradeoff": tmp_path / plots.TRADEOFF_PNG,
                       "probe": tmp_path / plots.PROBE_PNG, "objectives": tmp_path / plots.OBJECTIVES_PNG}
    for path in written.values():
        assert_png(path)


def test_the_recommendation_reaches_every_figure(report, tmp_path, monkeypatch):
    """Kept batch: history and trade-off name the status; the probe stars the recommended micro-batch."""
    kept = recommend(estimate(300.0, 60.0, 2000.0), current_batch_size=64, current_lr=0.1, optimizer="SGD",
                     probe=report["probe"])
    assert kept.status == "too_wide" and kept.batch_size == 64
    seen = {}
    for name in ("plot_history", "plot_tradeoff", "plot_probe"):
        original = getattr(plots.render, name)
        monkeypatch.setattr(plots.render, name,
                            lambda *a, _f=original, _n=name, **k: seen.setdefault(_n, _f(*a, **k)))
    plots.render_report({**report, "recommendation": kept.to_dict()}, tmp_path)
    (hax,) = seen["plot_history"].axes
    assert "current batch 64 = recommended (kept: status too_wide)" in [ln.get_label() for ln in hax.get_lines()]
    assert seen["plot_tradeoff"]._suptitle.get_text().startswith("Status: too_wide — the interval is too wide")
    _, bx = seen["plot_probe"].axes
    assert f"recommended micro-batch: {kept.micro_batch_size}" in [t.get_text() for t in bx.get_legend().get_texts()]


def test_missing_and_unreadable_sections_are_skipped(report, tmp_path):
    assert plots.render_report({"report_version": 1}, tmp_path) == {}
    assert set(plots.render_report({"estimate": estimate()}, tmp_path / "a")) == {"tradeoff"}
    unmeasured = {"estimate": estimate(b=None, lo=None, hi=None, steps=0), "history": []}
    assert plots.render_report(unmeasured, tmp_path / "b") == {}
    broken = {**report, "recommendation": {"status": "ok"}}  # an incompatible section: drawn from the estimate
    assert set(plots.render_report(broken, tmp_path / "c")) == {"history", "tradeoff", "probe"}
    with pytest.raises(ValueError, match="unreadable recommendation section"):
        plots.report_recommendation(broken)
    assert plots.report_recommendation({"estimate": estimate()}) is None
