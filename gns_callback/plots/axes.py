"""Figure and axis helpers shared by the plots: figures without pyplot, plain tick labels, legends off the data.

matplotlib is imported inside the functions, so importing :mod:`gns_callback.plots` costs nothing until a figure
is drawn, and no pyplot global state (backend, current figure) is touched.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

BLUE, ORANGE, GREEN, GREY, RED = "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f", "#d62728"

#: Mantissas for log-axis ticks, coarse to fine; the first set giving at least 3 ticks in range is used.
_MANTISSAS = ((1,), (1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9))


#: What to install for the pictures (the ``plots`` extra of setup.cfg).
PLOTS_EXTRA = "pip install 'gns_callback[plots]'"


def require_matplotlib() -> None:
    """``ImportError`` naming the extra to install where matplotlib is missing (the core install has no plots)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(f"the pictures need matplotlib, which is not installed: {PLOTS_EXTRA}") from err


def figure(width: float, height: float) -> "Figure":
    """A standalone :class:`~matplotlib.figure.Figure` with constrained layout (room for outside legends)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save(fig: "Figure", path: Optional[str | Path]) -> None:
    """Write ``fig`` as a PNG at ``path`` (parents created); nothing when ``path`` is ``None``."""
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)


def as_float(v: Any, missing: float = math.nan) -> float:
    """A report value as a float: JSON ``null`` → ``missing``; anything unreadable → ``nan``."""
    if v is None:
        return missing
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def positive(v: Optional[float]) -> bool:
    """Finite and above zero: drawable on a log axis."""
    return v is not None and math.isfinite(v) and v > 0


def plain_number(v: float) -> str:
    """A tick label without scientific notation: ``30``, ``1.5``, ``0.02``, ``8,192``."""
    if v >= 1e3 and float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:g}"


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick positions for a log axis over ``[lo, hi]``: the coarsest of 1 / 1-2-5 / 1-1.5-2-3-5-7 / every digit
    per decade that puts at least 3 ticks in range, else evenly spaced plain values (a very narrow range)."""
    from matplotlib.ticker import MaxNLocator

    decades = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
    ticks: list[float] = []
    for mantissas in _MANTISSAS:
        ticks = [float(f"{m * 10.0**e:.6g}") for e in decades for m in mantissas if lo <= m * 10.0**e <= hi]
        if len(ticks) >= 3:
            return ticks
    linear = [t for t in MaxNLocator(nbins=4).tick_values(lo, hi) if lo <= t <= hi and t > 0]
    return sorted(set(ticks) | {float(f"{t:.6g}") for t in linear})


def plain_log_axis(axis: Any, lo: float, hi: float) -> None:
    """Ticks from :func:`log_ticks` labelled as plain numbers (no ``3 × 10¹``), unlabelled minor ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    axis.set_major_locator(FixedLocator(log_ticks(lo, hi)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    axis.set_minor_formatter(NullFormatter())


def fixed_ticks(axis: Any, ticks: Sequence[float]) -> None:
    """Exactly these ticks, labelled as plain numbers, no minor ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    axis.set_major_locator(FixedLocator(list(ticks)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def legend_right(ax: "Axes") -> None:
    """The legend outside the axes, on the right: it can never hide a data point."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8)


def legend_below(ax: "Axes", ncols: int = 1) -> None:
    """The legend outside the axes, under the x label: it can never hide a data point."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), borderaxespad=0.0, fontsize=8, ncols=ncols)


def status_line(status: Optional[str], reason: Optional[str], width: int = 150) -> Optional[str]:
    """``Status: <status> — <reason>`` wrapped to ``width`` characters (``None`` without a status)."""
    if not status:
        return None
    text = f"Status: {status}" + (f" — {reason}" if reason else "")
    return "\n".join(textwrap.wrap(text, width))


def power_of_two_ticks(lo: float, hi: float, max_ticks: int = 10) -> list[int]:
    """Powers of two in ``[lo, hi]`` (every second, fourth, ... one when there are more than ``max_ticks``)."""
    powers = [2**e for e in range(0, 63) if lo <= 2**e <= hi]
    stride = max(1, math.ceil(len(powers) / max_ticks))
    return powers[::stride]


_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def byte_unit(n: float) -> tuple[str, int]:
    """The largest binary unit not above ``n`` bytes: ``("MiB", 2**20)`` for 3e6 (bytes for ``n < 1 KiB``)."""
    for name, size in _BYTE_UNITS:
        if abs(n) >= size:
            return name, size
    return "B", 1


def in_unit(n: float, unit: tuple[str, int]) -> str:
    """``n`` bytes in ``unit``, three significant digits or whole numbers: ``306 KiB``, ``1,229 MiB``."""
    v = n / unit[1]
    return f"{v:,.0f} {unit[0]}" if abs(v) >= 100 else f"{v:.3g} {unit[0]}"
