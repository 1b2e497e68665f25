"""McCandlish et al.'s steps/examples trade-off with the current and recommended batch marked.

With ``B_simple`` standing in for the noise scale (McCandlish, Kaplan, Amodei 2018, "An Empirical Model of
Large-Batch Training", call it ``B_noise``; the two agree when the Hessian is proportional to the identity), a
batch ``B`` needs ``S/S_min = 1 + B_simple/B`` steps and ``E/E_min = 1 + B/B_simple`` examples, so every batch
lies on the hyperbola ``(S/S_min − 1)(E/E_min − 1) = 1``; the knee ``B = B_simple`` costs twice the minimum of
both. The figures call the quantity ``B_simple`` throughout: it is the one measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gns_callback.plots.axes import (
    BLUE,
    GREEN,
    GREY,
    ORANGE,
    figure,
    fixed_ticks,
    legend_below,
    log_ticks,
    plain_log_axis,
    plain_number,
    positive,
    save,
    status_line,
)
from gns_callback.recommendation.tradeoff import examples_factor, steps_factor

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_MIN_TOP = 40.0  # the normalised panel shows at least 1 … 40 on both axes


@dataclass(frozen=True)
class BatchMark:
    """One marked global batch: the current one, the recommended one, or both at once when the batch is kept."""

    batch: float
    color: str
    marker: str
    size: float
    label: str


def batch_marks(current: Optional[float], recommended: Optional[float]) -> list[BatchMark]:
    """The marks to draw: one ``current = recommended (kept)`` mark when both are the same batch."""
    if current and recommended and float(current) == float(recommended):
        return [BatchMark(float(current), GREY, "D", 9, f"current = recommended B = {current:g} (kept)")]
    marks = []
    if current:
        marks.append(BatchMark(float(current), GREY, "D", 9, f"current B = {current:g}"))
    if recommended:
        marks.append(BatchMark(float(recommended), GREEN, "*", 14, f"recommended B = {recommended:g}"))
    return marks


def plot_tradeoff(
    b_simple: float,
    ci_low: float = math.nan,
    ci_high: float = math.nan,
    *,
    current_batch_size: Optional[float] = None,
    recommended_batch_size: Optional[float] = None,
    confidence: float = 0.95,
    status: Optional[str] = None,
    reason: Optional[str] = None,
    path: Optional[str | Path] = None,
) -> Optional["Figure"]:
    """The hyperbola with the batches marked (left) and both factors against the batch size (right).

    ``status``/``reason`` (the recommendation's) are printed above the panels. ``None`` when ``b_simple`` is not
    a finite positive number (nothing measured, or unbounded).
    """
    if not positive(b_simple):
        return None
    marks = batch_marks(current_batch_size, recommended_batch_size)
    level = round(100 * confidence)
    fig = figure(11, 5.8)
    left, right = fig.subplots(1, 2)
    _draw_normalised(left, b_simple, ci_low, ci_high, marks, level)
    _draw_factors(right, b_simple, ci_low, ci_high, marks, level)
    text = status_line(status, reason)
    if text:
        fig.suptitle(text, fontsize=9, x=0.01, ha="left")
    save(fig, path)
    return fig


def _draw_normalised(
    ax: "Axes", b: float, ci_low: float, ci_high: float, marks: list[BatchMark], level: int
) -> None:
    """``(E/E_min, S/S_min) = (1 + u, 1 + 1/u)`` with ``u = B/B_simple``: the same curve for every B_simple."""
    import numpy as np

    u = np.logspace(-3, 3, 600)
    ax.plot(1 + u, 1 + 1 / u, color="black", lw=1.2, label="(S/S_min − 1)(E/E_min − 1) = 1")
    ax.plot([2], [2], marker="o", ms=7, mfc="white", mec="black", ls="none", label="knee: B = B_simple")
    for r in (0.125, 0.25, 0.5, 2, 4, 8):
        ax.plot([1 + r], [1 + 1 / r], marker=".", color=GREY, ls="none")
        label = plain_number(float(f"{r * b:.3g}"))
        ax.annotate(f"B≈{label}", (1 + r, 1 + 1 / r), textcoords="offset points", xytext=(4, 4), fontsize=7, color=GREY)
    for mark in marks:
        _draw_mark_on_curve(ax, mark, b, ci_low, ci_high, level)
    top = max([_MIN_TOP] + [1.3 * (1 + max(m.batch / b, b / m.batch)) for m in marks])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1, top)
    ax.set_ylim(1, top)
    for axis in (ax.xaxis, ax.yaxis):
        plain_log_axis(axis, 1, top)
    ax.set_xlabel("E/E_min  (examples processed, relative)")
    ax.set_ylabel("S/S_min  (optimizer steps, relative)")
    ax.set_title(f"Steps vs examples to reach the same loss (B_simple ≈ {b:.3g})", fontsize=10)
    ax.grid(True, which="major", alpha=0.25)
    legend_below(ax)


def _draw_mark_on_curve(ax: "Axes", mark: BatchMark, b: float, ci_low: float, ci_high: float, level: int) -> None:
    """The mark at ``u = B/B_simple``, and a band where the interval moves it: ``u`` from B/ci_high to B/ci_low."""
    import numpy as np

    u_lo = mark.batch / ci_high if positive(ci_high) else 1e-3
    u_hi = mark.batch / ci_low if positive(ci_low) else 1e3
    if u_lo < u_hi:
        seg = np.logspace(math.log10(u_lo), math.log10(u_hi), 100)
        ax.plot(1 + seg, 1 + 1 / seg, color=mark.color, lw=7, alpha=0.3, solid_capstyle="round")
    u = mark.batch / b
    ax.plot([1 + u], [1 + 1 / u], marker=mark.marker, ms=mark.size, color=mark.color, mec="black", ls="none",
            label=f"{mark.label} (band: {level}% interval)")


def _draw_factors(ax: "Axes", b: float, ci_low: float, ci_high: float, marks: list[BatchMark], level: int) -> None:
    """``S/S_min`` and ``E/E_min`` against the global batch, bands for B_simple in its interval, batches marked."""
    import numpy as np

    ends = [v for v in [m.batch for m in marks] + [ci_low, ci_high, b] if positive(v)]
    bs = np.logspace(math.log10(max(min(ends) / 4, 1e-3)), math.log10(max(ends) * 4), 300)
    top = 2 * _MIN_TOP
    ax.plot(bs, [steps_factor(x, b) for x in bs], color=BLUE, lw=1.8, label="S/S_min = 1 + B_simple/B (steps)")
    ax.plot(bs, [examples_factor(x, b) for x in bs], color=ORANGE, lw=1.8,
            label="E/E_min = 1 + B/B_simple (examples)")
    _draw_factor_bands(ax, bs, b, ci_low, ci_high, top, level)
    ax.axvline(b, color="black", lw=0.8, ls="--", label=f"B_simple = {b:.3g}")
    for mark in marks:
        ax.axvline(mark.batch, color=mark.color, lw=1.5, ls=":" if mark.color == GREY else "-.", label=mark.label)
    ax.axhline(2, color="black", lw=0.5, alpha=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(1, top)
    ax.set_xlim(bs[0], bs[-1])
    plain_log_axis(ax.yaxis, 1, top)
    fixed_ticks(ax.xaxis, log_ticks(bs[0], bs[-1]))
    ax.set_xlabel("global batch size B")
    ax.set_ylabel("factor over the minimum")
    unbounded = "" if positive(ci_high) else " (interval unbounded above)"
    ax.set_title(f"Cost of a batch size: steps and examples{unbounded}", fontsize=10)
    ax.grid(True, which="major", alpha=0.25)
    legend_below(ax, ncols=2)


def _draw_factor_bands(ax: "Axes", bs, b: float, ci_low: float, ci_high: float, top: float, level: int) -> None:
    if not (positive(ci_low) or positive(ci_high)):
        return
    lo = ci_low if positive(ci_low) else b
    hi = ci_high if positive(ci_high) else math.inf
    ax.fill_between(bs, [steps_factor(x, lo) for x in bs], [min(steps_factor(x, hi), 2 * top) for x in bs],
                    color=BLUE, alpha=0.15, linewidth=0)
    ax.fill_between(bs, [examples_factor(x, hi) for x in bs], [min(examples_factor(x, lo), 2 * top) for x in bs],
                    color=ORANGE, alpha=0.15, linewidth=0, label=f"{level}% interval of B_simple")
