"""The probe: memory per micro-batch size with the fitted line and the budget (left), throughput (right).

Reads the report's ``"probe"`` section (``ProbeResult.to_dict()``; a ``ProbeResult`` works too):
``max_micro_batch``, ``capped`` (the probe's ``max_batch_size``, not memory, stopped the search),
``fixed_bytes``/``bytes_per_sample`` (the fit ``bytes(b) = fixed + per_sample·b``), ``budget_bytes``,
``headroom``, ``measure`` (``"cuda"``: the allocator's peak; ``"accounting"``: tensor bytes counted, e.g. on a
CPU), ``trials`` (``size``, ``ok``, ``measured_bytes``) and ``throughput``. The throughput table and the trials
are read through the recommendation's probe view, so both read a probe the same way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from gns_callback.plots.axes import (
    BLUE,
    GREEN,
    GREY,
    ORANGE,
    RED,
    as_float,
    byte_unit,
    figure,
    fixed_ticks,
    in_unit,
    legend_below,
    plain_log_axis,
    positive,
    power_of_two_ticks,
    save,
)
from gns_callback.recommendation.sizing import parse_trial, probe_inputs
from gns_callback.recommendation.tradeoff import throughput_at

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

#: A budget more than this many times the largest value drawn is stated in words, not drawn (it would flatten
#: the measurements against the x axis).
BUDGET_OFF_SCALE = 3.0
#: The same on the log axis used when the sizes span decades.
BUDGET_OFF_SCALE_LOG = 1000.0
#: Sizes spanning more than this ratio get log axes (log₂ sizes, log bytes).
_LOG_X_RATIO = 64

_MEASURES = {"cuda": "allocator peak", "accounting": "tensor bytes counted"}


@dataclass(frozen=True)
class ProbeMemory:
    """What the memory panel draws. Bytes are floats (``nan``: unknown)."""

    fits: list[tuple[int, float]]  # (size, bytes) that ran within the limit
    over: list[tuple[int, float]]  # (size, bytes) measured above the limit
    oom: list[int]  # sizes that failed without a byte count (out of memory)
    fixed: float
    per_sample: float
    budget: float
    headroom: float
    max_micro: Optional[int]
    capped: bool
    measure: Optional[str]

    @classmethod
    def read(cls, probe: Mapping[str, Any]) -> "ProbeMemory":
        trials = [t for t in map(parse_trial, probe.get("trials") or ()) if (t.split or 1) == 1]
        measured = [t for t in trials if t.bytes is not None and math.isfinite(t.bytes)]
        max_micro = probe.get("max_micro_batch")
        return cls(
            fits=[(t.size, t.bytes) for t in measured if t.ok],
            over=[(t.size, t.bytes) for t in measured if not t.ok],
            oom=[t.size for t in trials if not t.ok and (t.bytes is None or not math.isfinite(t.bytes))],
            fixed=as_float(probe.get("fixed_bytes")),
            per_sample=as_float(probe.get("bytes_per_sample")),
            budget=as_float(probe.get("budget_bytes")),
            headroom=as_float(probe.get("headroom"), 1.0),
            max_micro=None if max_micro is None else int(max_micro),
            capped=bool(probe.get("capped")),
            measure=probe.get("measure"),
        )

    @property
    def has_fit(self) -> bool:
        return math.isfinite(self.fixed) and math.isfinite(self.per_sample)

    def at(self, size: float) -> float:
        """The fitted bytes at ``size``."""
        return self.fixed + self.per_sample * size

    @property
    def empty(self) -> bool:
        return not (self.fits or self.over or self.has_fit)


def plot_probe(
    probe: Mapping[str, Any] | Any, *, chosen_micro_batch: Optional[int] = None, path: Optional[str | Path] = None
) -> Optional["Figure"]:
    """Memory per micro-batch with the fit and the budget (left), samples/s per micro-batch (right).

    ``chosen_micro_batch`` (the recommendation's) is starred on the throughput curve; without it, the fastest
    measured size that fits. ``None`` when the probe measured neither memory nor throughput.
    """
    if probe is None:
        return None
    data = probe.to_dict() if hasattr(probe, "to_dict") else probe
    memory = ProbeMemory.read(data)
    table = probe_inputs(data)[1]
    if memory.empty and not table:
        return None
    fig = figure(11, 5.2)
    ax, bx = fig.subplots(1, 2)
    sizes = [s for s, _ in memory.fits + memory.over] + memory.oom + list(table)
    sizes += [memory.max_micro] if memory.max_micro else []
    _draw_memory(ax, memory, sizes or [1])
    _draw_throughput(bx, table, memory.max_micro, chosen_micro_batch)
    save(fig, path)
    return fig


def _draw_memory(ax: "Axes", m: ProbeMemory, sizes: list[int]) -> None:
    log = max(sizes) / max(min(sizes), 1) > _LOG_X_RATIO
    xs = _size_axis(ax, min(sizes), max(sizes), log)
    values = [b for _, b in m.fits + m.over] + ([m.at(xs[0]), m.at(xs[-1])] if m.has_fit else [])
    data_top = max(values + [1.0])
    limit = (BUDGET_OFF_SCALE_LOG if log else BUDGET_OFF_SCALE) * data_top
    budget_drawn = positive(m.budget) and (m.budget <= limit or bool(m.oom))
    top = max(data_top, m.budget if budget_drawn else 0.0)
    unit = byte_unit(data_top)
    if m.has_fit:
        ax.plot(xs, [m.at(x) / unit[1] for x in xs], color=BLUE, lw=1.5, label=_fit_label(m))
    _draw_trials(ax, m, unit, budget_drawn)
    if budget_drawn:
        _draw_budget(ax, m, unit)
    elif positive(m.budget):
        _state_budget_off_scale(ax, m, data_top)
    _draw_max_micro(ax, m)
    _memory_y_axis(ax, [v for v in values if positive(v)], top, unit, log)
    ax.set_xlabel("micro-batch size (per device)")
    how = _MEASURES.get(m.measure or "", m.measure)
    ax.set_ylabel(f"peak memory ({unit[0]}" + (f"; {how})" if how else ")"))
    ax.set_title("Memory per micro-batch size", fontsize=10)
    ax.grid(True, alpha=0.3)
    if m.empty:
        ax.text(0.5, 0.5, "no memory measured", ha="center", va="center", transform=ax.transAxes, color=GREY)
    legend_below(ax)


def _size_axis(ax: "Axes", lo: float, hi: float, log: bool) -> list[float]:
    """Linear x from 0, or log₂ with power-of-two ticks; returns the x values to draw the fit at."""
    import numpy as np

    if not log:
        ax.set_xlim(0, hi * 1.15)
        return list(np.linspace(0, hi * 1.15, 100))
    ax.set_xscale("log", base=2)
    x_lo, x_hi = max(lo, 1) / 1.5, hi * 1.5
    ax.set_xlim(x_lo, x_hi)
    fixed_ticks(ax.xaxis, power_of_two_ticks(x_lo, x_hi))
    return list(np.geomspace(x_lo, x_hi, 200))


def _memory_y_axis(ax: "Axes", values: list[float], top: float, unit: tuple[str, int], log: bool) -> None:
    """From 0 on a linear axis; on a log axis (sizes spanning decades) from below the smallest value."""
    if not log or not values:
        ax.set_ylim(0, top * 1.1 / unit[1])
        return
    lo, hi = min(values) / 1.5 / unit[1], top * 1.5 / unit[1]
    ax.set_yscale("log")
    ax.set_ylim(lo, hi)
    plain_log_axis(ax.yaxis, lo, hi)


def _fit_label(m: ProbeMemory) -> str:
    """``fit: 306 KiB + 1.3 KiB/sample``: one unit for both terms (the smaller one's)."""
    unit = byte_unit(min(abs(m.fixed), abs(m.per_sample)) or max(abs(m.fixed), abs(m.per_sample)))
    return f"fit: {in_unit(m.fixed, unit)} + {in_unit(m.per_sample, unit)}/sample"


def _draw_trials(ax: "Axes", m: ProbeMemory, unit: tuple[str, int], budget_drawn: bool) -> None:
    if m.fits:
        ax.plot([s for s, _ in m.fits], [b / unit[1] for _, b in m.fits], "o", color=BLUE, mec="black",
                label="measured (fits)")
    if m.over:
        ax.plot([s for s, _ in m.over], [b / unit[1] for _, b in m.over], "x", color=RED, ms=9, mew=2,
                label="measured over the limit")
    if m.oom and budget_drawn:
        ax.plot(m.oom, [m.budget / unit[1]] * len(m.oom), "x", color=RED, ms=9, mew=2,
                label="out of memory (drawn at the budget)")


def _draw_budget(ax: "Axes", m: ProbeMemory, unit: tuple[str, int]) -> None:
    """The budget and the usable part of it, at the axis' unit, labelled in the budget's own unit."""
    own = byte_unit(m.budget)
    ax.axhline(m.budget / unit[1], color=RED, ls="--", lw=1.2, label=f"budget {in_unit(m.budget, own)}")
    if 0 < m.headroom < 1:
        ax.axhline(m.headroom * m.budget / unit[1], color=RED, ls=":", lw=1.2,
                   label=f"usable: {m.headroom:g} × budget = {in_unit(m.headroom * m.budget, own)}")


def _state_budget_off_scale(ax: "Axes", m: ProbeMemory, data_top: float) -> None:
    """The budget in words: drawn to scale it would flatten every measurement to zero."""
    budget_unit = byte_unit(m.budget)
    usable = f" (usable {in_unit(m.headroom * m.budget, budget_unit)})" if 0 < m.headroom < 1 else ""
    ax.text(0.02, 0.97, f"budget {in_unit(m.budget, budget_unit)}{usable}: {m.budget / data_top:,.0f}× the\n"
            "largest value drawn, off the scale. Memory does not limit this range.",
            transform=ax.transAxes, va="top", ha="left", fontsize=8, color=RED)


def _draw_max_micro(ax: "Axes", m: ProbeMemory) -> None:
    if not m.max_micro:
        return
    if m.capped:
        label = f"largest size tried: {m.max_micro} (the probe's upper limit on sizes; memory was not the limit)"
    else:
        label = f"largest micro-batch that fits: {m.max_micro}"
    ax.axvline(m.max_micro, color=GREEN, ls="-.", lw=1.5, label=label)


def _draw_throughput(
    bx: "Axes", table: dict[int, float], max_micro: Optional[int], chosen: Optional[int]
) -> None:
    bx.set_xlabel("micro-batch size (per device)")
    bx.set_ylabel("samples / s (per device)")
    bx.set_title("Throughput per micro-batch size", fontsize=10)
    bx.grid(True, alpha=0.3)
    if not table:
        bx.text(0.5, 0.5, "no throughput measured", ha="center", va="center", transform=bx.transAxes, color=GREY)
        return
    from matplotlib.ticker import FuncFormatter

    xs = sorted(table)
    bx.plot(xs, [table[x] for x in xs], "o-", color=ORANGE, mec="black", label="measured")
    fits = [x for x in xs if not max_micro or x <= max_micro] or xs
    star = chosen or max(fits, key=lambda x: (table[x], x))
    label = f"recommended micro-batch: {star}" if chosen else f"fastest that fits: {star}"
    if star not in table:
        label += " (interpolated)"
    bx.plot([star], [throughput_at(table, star)], "*", ms=15, color=GREEN, mec="black", label=label)
    bx.set_xscale("log", base=2)
    fixed_ticks(bx.xaxis, xs)
    bx.set_ylim(bottom=0, top=max(table.values()) * 1.15)
    bx.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    legend_below(bx)
