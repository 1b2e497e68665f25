"""Figures for a GNS report (matplotlib, imported lazily; no pyplot, so no global backend or figure state).

Each ``plot_*`` returns a :class:`matplotlib.figure.Figure` (``None`` when its data are missing) and writes a PNG
when ``path`` is given; :func:`render_report` draws whatever a report's sections allow. Modules:
:mod:`.history` (B_simple over training), :mod:`.tradeoff` (steps vs examples), :mod:`.objective` (time and examples per objective), :mod:`.probe` (memory and
throughput per micro-batch), :mod:`.render` (a whole report), :mod:`.axes` (ticks, legends, units).
"""

from gns_callback.plots.history import plot_history
from gns_callback.plots.objective import plot_objectives
from gns_callback.plots.probe import plot_probe
from gns_callback.plots.render import (
    HISTORY_PNG,
    OBJECTIVES_PNG,
    PROBE_PNG,
    TRADEOFF_PNG,
    render_report,
    report_recommendation,
)
from gns_callback.plots.tradeoff import plot_tradeoff

__all__ = [
    "HISTORY_PNG",
    "OBJECTIVES_PNG",
    "PROBE_PNG",
    "TRADEOFF_PNG",
    "plot_history",
    "plot_objectives",
    "plot_probe",
    "plot_tradeoff",
    "render_report",
    "report_recommendation",
]
