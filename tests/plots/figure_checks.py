"""Reading a drawn figure back: tick label text, every text shown, legend boxes against data points."""

from __future__ import annotations

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.collections import PolyCollection
from matplotlib.lines import Line2D
from matplotlib.transforms import Bbox

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def draw(fig):
    """Lay out and draw ``fig`` (constrained layout, legends placed) and return its renderer."""
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def tick_labels(fig) -> list[str]:
    """Every non-empty tick label, major and minor, of every axis, as drawn."""
    draw(fig)
    labels = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            labels += [t.get_text() for t in axis.get_ticklabels(which="both") if t.get_text()]
    return labels


def texts(fig) -> list[str]:
    """Titles, axis labels, legend entries, free text and annotations, and the figure's suptitle."""
    out = [fig._suptitle.get_text()] if fig._suptitle is not None else []
    for ax in fig.axes:
        out += [ax.get_title(), ax.get_xlabel(), ax.get_ylabel()]
        out += [t.get_text() for t in ax.texts]
        legend = ax.get_legend()
        if legend is not None:
            out += [t.get_text() for t in legend.get_texts()]
    return [t for t in out if t]


def legend_labels(ax) -> list[str]:
    legend = ax.get_legend()
    return [] if legend is None else [t.get_text() for t in legend.get_texts()]


def data_points(ax) -> np.ndarray:
    """Display coordinates of every line vertex and band vertex inside the axes' view (n × 2)."""
    points = []
    for line in ax.get_lines():
        xy = np.column_stack([line.get_xdata(orig=False), line.get_ydata(orig=False)]).astype(float)
        points.append(xy[np.isfinite(xy).all(axis=1)])
    for coll in ax.collections:
        if isinstance(coll, PolyCollection):
            for path in coll.get_paths():
                points.append(path.vertices)
    xy = np.concatenate(points) if points else np.zeros((0, 2))
    (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
    inside = (xy[:, 0] >= x0) & (xy[:, 0] <= x1) & (xy[:, 1] >= y0) & (xy[:, 1] <= y1)
    return ax.transData.transform(xy[inside])


def legend_box(fig, ax) -> Bbox:
    renderer = draw(fig)
    return ax.get_legend().get_window_extent(renderer)


def points_under_legend(fig, ax, points=None) -> int:
    """How many data points (display coordinates) the legend's box covers."""
    box = legend_box(fig, ax)
    pts = data_points(ax) if points is None else points
    return int(sum(box.contains(x, y) for x, y in pts))


def labelled_line(ax, prefix: str) -> Line2D:
    (line,) = [ln for ln in ax.get_lines() if ln.get_label().startswith(prefix)]
    return line
