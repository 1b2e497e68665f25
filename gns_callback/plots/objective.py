"""Predicted wall time and examples to the same loss against the global batch, the three objectives marked.

Both relative to the current setting (:mod:`gns_callback.recommendation.objective`): examples
``E(B)/E(B_current) = (B_simple + B)/(B_simple + B_current)``, wall time ``(1 + B_simple/B)·a·t(m)`` over the
current's, from the probe's measured step time per micro-batch ``t(m)`` on the current device count. Bands: the
``B_simple`` interval.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from gns_callback.plots.axes import (
    BLUE,
    GREEN,
    GREY,
    ORANGE,
    figure,
    fixed_ticks,
    legend_below,
    log_ticks,
    positive,
    save,
)
from gns_callback.recommendation.objective import OBJECTIVES, Config, StepTimes, examples_ratio, time_curve
from gns_callback.recommendation.sizing import preferred_micro, probe_inputs

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from gns_callback.recommendation import Recommendation

#: How each objective's plan is marked: colour and marker.
STYLE = {"balanced": (BLUE, "o"), "time": (GREEN, "*"), "cost": (ORANGE, "s")}


def plot_objectives(rec: "Recommendation", probe: Any, *, path: Optional[str | Path] = None) -> Optional["Figure"]:
    """Time (left) and examples (right) relative to the current setting against the global batch, with the
    current batch and each objective's plan marked (the chosen one in the title).

    ``probe``: the probe result (object or its ``to_dict()``) whose step times the plans used. ``None`` when
    the recommendation has no plans, no finite positive ``B_simple``, or the probe timed nothing.
    """
    view = probe_inputs(probe)
    times = StepTimes(view.throughput)
    if not rec.plans or not positive(rec.b_noise) or not times.measured:
        return None
    cur = rec.current
    current = Config(cur.batch_size, cur.micro_batch_size or cur.batch_size, cur.accumulate_grad_batches or 1,
                     cur.num_devices)
    cap, _ = preferred_micro(view.max_micro_batch, view.throughput, cur.micro_batch_size)
    batches = _batch_range(rec, current)
    fig = figure(11, 5.6)
    left, right = fig.subplots(1, 2)
    curve = {b: time_curve(batches, b, current, times, cap) for b in (rec.b_noise, rec.ci_low, rec.ci_high)
             if positive(b)}
    _panel(left, batches, curve, rec, "time")
    examples = {b: [examples_ratio(x, current.batch_size, b) for x in batches] for b in curve}
    _panel(right, batches, examples, rec, "examples")
    left.set_ylabel("predicted wall time to the same loss, relative to the current")
    right.set_ylabel("examples to the same loss, relative to the current")
    fig.suptitle(f"Objective: {rec.objective} (B_simple = {rec.b_noise:.3g}; step times from the probe, "
                 f"{current.num_devices} device(s))", fontsize=10, x=0.01, ha="left")
    save(fig, path)
    return fig


def _batch_range(rec: "Recommendation", current: Config) -> list[float]:
    import numpy as np

    ends = [current.batch_size, rec.b_noise] + [p.batch_size for p in rec.plans.values() if p.batch_size]
    lo, hi = max(min(ends) / 4, 1.0), max(ends) * 4
    return list(np.logspace(math.log10(lo), math.log10(hi), 300))


def _panel(ax: "Axes", batches: list[float], curves: dict[float, list[float]], rec: "Recommendation",
           kind: str) -> None:
    """The curve at B_simple, its band over the interval, the current batch and the three plans."""
    mid = curves[rec.b_noise]
    ax.plot(batches, mid, color="black", lw=1.6, label=f"at B_simple = {rec.b_noise:.3g}")
    ends = [curves[b] for b in (rec.ci_low, rec.ci_high) if b in curves and b != rec.b_noise]
    if len(ends) == 2:
        low = [min(a, b) for a, b in zip(*ends)]
        high = [max(a, b) for a, b in zip(*ends)]
        ax.fill_between(batches, low, high, color=GREY, alpha=0.25, linewidth=0,
                        label=f"{round(100 * rec.confidence)}% interval of B_simple")
    ax.plot([rec.current.batch_size], [1.0], marker="D", ms=8, color=GREY, mec="black", ls="none",
            label=f"current B = {rec.current.batch_size}")
    for name in OBJECTIVES:
        _mark(ax, rec, name, kind)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(batches[0], batches[-1])
    fixed_ticks(ax.xaxis, log_ticks(batches[0], batches[-1]))
    ax.set_xlabel("global batch size B")
    ax.set_title("Wall time (probe's step times)" if kind == "time" else "Examples (compute)", fontsize=10)
    ax.grid(True, which="major", alpha=0.25)
    legend_below(ax, ncols=2)


def _mark(ax: "Axes", rec: "Recommendation", name: str, kind: str) -> None:
    plan = rec.plans.get(name)
    ratio = None if plan is None else (plan.time if kind == "time" else plan.examples)
    if plan is None or plan.batch_size is None or ratio is None or not math.isfinite(ratio.value):
        return
    color, marker = STYLE[name]
    chosen = " (recommended)" if name == rec.objective else ""
    devices = f", {plan.num_devices} devices" if plan.num_devices != rec.current.num_devices else ""
    ax.plot([plan.batch_size], [ratio.value], marker=marker, ms=13 if chosen else 9, color=color, mec="black",
            ls="none", label=f"{name}: B = {plan.batch_size}{devices}{chosen}")
