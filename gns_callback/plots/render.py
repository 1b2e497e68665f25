"""``render_report``: every PNG a report's sections allow, with the recommendation's batches and status."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from gns_callback.plots.axes import as_float
from gns_callback.plots.history import plot_history
from gns_callback.plots.objective import plot_objectives
from gns_callback.plots.probe import plot_probe
from gns_callback.plots.tradeoff import plot_tradeoff

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from gns_callback.recommendation import Recommendation

HISTORY_PNG = "gns_history.png"
TRADEOFF_PNG = "gns_tradeoff.png"
PROBE_PNG = "gns_probe.png"
OBJECTIVES_PNG = "gns_objectives.png"


def report_recommendation(report: Mapping[str, Any]) -> Optional["Recommendation"]:
    """The report's ``"recommendation"`` section as a :class:`Recommendation` (``None`` when absent).

    Raises:
        ValueError: the section is there but cannot be read (written by an incompatible version).
    """
    from gns_callback.recommendation import Recommendation

    section = report.get("recommendation")
    if not section:
        return None
    try:
        return Recommendation.from_dict(section)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise ValueError(f"unreadable recommendation section ({err!r})") from err


def render_report(
    report: Mapping[str, Any], out_dir: str | Path, *, recommendation: Optional["Recommendation"] = None
) -> dict[str, Path]:
    """Write the PNGs that ``report``'s sections allow into ``out_dir``; returns ``{name: path}``.

    ``recommendation`` overrides the report's ``"recommendation"`` section (an unreadable section is ignored).
    """
    if recommendation is None:
        try:
            recommendation = report_recommendation(report)
        except ValueError:
            recommendation = None
    out = Path(out_dir)
    figures = {
        "history": (HISTORY_PNG, lambda path: _history(report, recommendation, path)),
        "tradeoff": (TRADEOFF_PNG, lambda path: _tradeoff(report, recommendation, path)),
        "probe": (PROBE_PNG, lambda path: _probe(report, recommendation, path)),
        "objectives": (OBJECTIVES_PNG, lambda path: _objectives(report, recommendation, path)),
    }
    written = {}
    for name, (filename, draw) in figures.items():
        if draw(out / filename) is not None:
            written[name] = out / filename
    return written


def _estimate(report: Mapping[str, Any]) -> Mapping[str, Any]:
    return report.get("run_estimate") or report.get("estimate") or {}


def _history(report: Mapping[str, Any], rec: Optional["Recommendation"], path: Path) -> Optional["Figure"]:
    if not report.get("history"):
        return None
    return plot_history(
        report["history"],
        current_batch_size=rec.current.batch_size if rec else None,
        recommended_batch_size=rec.batch_size if rec else None,
        confidence=as_float(_estimate(report).get("confidence"), 0.95),
        status=rec.status if rec else None,
        path=path,
    )


def _tradeoff(report: Mapping[str, Any], rec: Optional["Recommendation"], path: Path) -> Optional["Figure"]:
    if rec is not None:
        return plot_tradeoff(
            rec.b_noise, rec.ci_low, rec.ci_high, current_batch_size=rec.current.batch_size,
            recommended_batch_size=rec.batch_size, confidence=rec.confidence, status=rec.status, reason=rec.reason,
            path=path,
        )
    est = _estimate(report)
    if not est:
        return None
    return plot_tradeoff(
        as_float(est.get("b_simple")), as_float(est.get("ci_low")), as_float(est.get("ci_high"), math.inf),
        confidence=as_float(est.get("confidence"), 0.95), path=path,
    )


def _probe(report: Mapping[str, Any], rec: Optional["Recommendation"], path: Path) -> Optional["Figure"]:
    if not report.get("probe"):
        return None
    return plot_probe(report["probe"], chosen_micro_batch=rec.micro_batch_size if rec else None, path=path)


def _objectives(report: Mapping[str, Any], rec: Optional["Recommendation"], path: Path) -> Optional["Figure"]:
    if rec is None or not report.get("probe"):
        return None
    return plot_objectives(rec, report["probe"], path=path)
