"""B_simple over training: the recent value with its interval, the run average, the batch sizes, fit end.

Reads the report's ``"history"`` section: ``[{"step", "b_simple", "ci_low", "ci_high", "b_simple_run"?,
"final"?}, ...]``. JSON ``null`` in ``b_simple``/``ci_high`` means unbounded (|G|² not resolved from the noise),
except where ``ci_low`` is ``null`` too: then the entry was not measured (measuring stopped, or the estimate was
withheld; :func:`~gns_callback.json_values.unmeasured`), drawn as a grey span without an interval. An entry with
``"final": true`` is the value at the end of the fit and is marked "fit end".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from gns_callback.json_values import unmeasured
from gns_callback.plots.axes import (
    BLUE,
    GREEN,
    GREY,
    ORANGE,
    as_float,
    figure,
    legend_right,
    plain_log_axis,
    positive,
    save,
)

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class HistorySeries:
    """The history as columns, sorted by step; ``nan`` where a value is missing, ``inf`` where unbounded."""

    steps: list[int]
    b_simple: list[float]
    ci_low: list[float]
    ci_high: list[float]
    run: list[float]
    final_index: Optional[int]
    measured: list[bool]

    @classmethod
    def from_rows(cls, history: Sequence[Mapping[str, Any]]) -> "HistorySeries":
        rows = sorted((r for r in history or () if r.get("step") is not None), key=lambda r: r["step"])
        finals = [i for i, r in enumerate(rows) if r.get("final") is True]
        return cls(
            steps=[int(r["step"]) for r in rows],
            b_simple=[as_float(r.get("b_simple")) for r in rows],
            ci_low=[as_float(r.get("ci_low")) for r in rows],
            ci_high=[as_float(r.get("ci_high"), math.nan if unmeasured(r) else math.inf) for r in rows],
            run=[as_float(r.get("b_simple_run")) for r in rows],
            final_index=finals[-1] if finals else None,
            measured=[not unmeasured(r) for r in rows],
        )

    def drawable(self) -> list[float]:
        """Every value that can go on the log axis."""
        return [v for v in self.b_simple + self.ci_low + self.ci_high + self.run if positive(v)]


def plot_history(
    history: Sequence[Mapping[str, Any]],
    *,
    current_batch_size: Optional[float] = None,
    recommended_batch_size: Optional[float] = None,
    confidence: float = 0.95,
    status: Optional[str] = None,
    path: Optional[str | Path] = None,
) -> Optional["Figure"]:
    """B_simple over training on a log axis, with its interval band, the run average and the batch sizes.

    ``status`` (the recommendation's) is named on the batch line when the recommended batch equals the current
    one (the batch was kept). The legend sits outside the axes. ``None`` when nothing drawable was logged.
    """
    series = HistorySeries.from_rows(history)
    batches = [float(v) for v in (current_batch_size, recommended_batch_size) if v is not None and positive(float(v))]
    values = series.drawable() + batches
    if not series.steps or not series.drawable():
        return None
    y_min, y_max = min(values) / 1.5, max(values) * 1.5
    fig = figure(9.5, 4.5)
    ax = fig.add_subplot()
    _draw_band(ax, series, y_min, y_max, round(100 * confidence))
    _draw_lines(ax, series)
    _draw_fit_end(ax, series)
    _draw_not_measured(ax, series)
    _draw_batches(ax, current_batch_size, recommended_batch_size, status)
    ax.set_yscale("log")
    ax.set_ylim(y_min, y_max)
    plain_log_axis(ax.yaxis, y_min, y_max)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("B_simple (examples)")
    ax.set_title("Gradient noise scale B_simple over training")
    ax.grid(True, which="major", alpha=0.3)
    legend_right(ax)
    save(fig, path)
    return fig


def _draw_band(ax: "Axes", s: HistorySeries, y_min: float, y_max: float, level: int) -> None:
    """The recent value's interval; a missing/zero lower end drawn at the bottom, an unbounded upper end at the top."""

    def clip(v: float) -> float:
        return min(max(v, y_min), y_max) if positive(v) or math.isinf(v) else y_min

    unbounded = any(math.isinf(v) for v in s.ci_high)
    label = f"{level}% interval (recent)" + ("; cut at the top where unbounded" if unbounded else "")
    ax.fill_between(s.steps, [clip(v) for v in s.ci_low], [clip(v) for v in s.ci_high], where=s.measured,
                    color=BLUE, alpha=0.2, linewidth=0, label=label)


def _draw_lines(ax: "Axes", s: HistorySeries) -> None:
    few = len(s.steps) < 30
    ax.plot(s.steps, [v if positive(v) else math.nan for v in s.b_simple], color=BLUE, lw=1.8,
            marker="o" if few else None, ms=3, label="B_simple (recent, EMA)")
    if any(positive(v) for v in s.run):
        ax.plot(s.steps, [v if positive(v) else math.nan for v in s.run], color=ORANGE, lw=1.5, ls="--",
                label="B_simple (run average)")


def _draw_fit_end(ax: "Axes", s: HistorySeries) -> None:
    """A vertical line at the final entry's step, and a square on each series there."""
    i = s.final_index
    if i is None:
        return
    step = s.steps[i]
    ax.axvline(step, color="black", lw=0.9, ls=(0, (4, 3)), label=f"fit end (step {step})")
    for value, color in ((s.b_simple[i], BLUE), (s.run[i], ORANGE)):
        if positive(value):
            ax.plot([step], [value], marker="s", ms=7, mfc="white", mec=color, mew=2, ls="none")


def _draw_not_measured(ax: "Axes", s: HistorySeries) -> None:
    """A grey span over each run of entries that were not measured, from the last measured entry before it. Before,
    their ``null`` upper ends read as unbounded: a run that stopped measuring showed an interval from the bottom of
    the plot to its top, labelled "cut at the top where unbounded"."""
    label = "not measured (the report's estimate.failure says why)"
    for i, measured in enumerate(s.measured):
        if measured or (i > 0 and not s.measured[i - 1]):
            continue
        end = i
        while end + 1 < len(s.measured) and not s.measured[end + 1]:
            end += 1
        start = s.steps[i - 1] if i > 0 else s.steps[i]
        ax.axvspan(start, s.steps[end], color=GREY, alpha=0.25, lw=0, label=label)
        label = None


def _draw_batches(
    ax: "Axes", current: Optional[float], recommended: Optional[float], status: Optional[str]
) -> None:
    """Horizontal lines at the current and recommended global batch; one line when the batch is kept."""
    kept = recommended is not None and current is not None and float(recommended) == float(current)
    if current:
        label = f"current batch {current:g}"
        if kept:
            label += " = recommended (kept" + (f": status {status})" if status else ")")
        ax.axhline(current, color=GREY, ls=":", lw=1.5, label=label)
    if recommended and not kept:
        ax.axhline(recommended, color=GREEN, ls="-.", lw=1.5, label=f"recommended batch {recommended:g}")
