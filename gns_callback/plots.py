"""Figures for a GNS report (matplotlib, imported lazily; no pyplot, so no global backend or figure state).

Each ``plot_*`` returns a :class:`matplotlib.figure.Figure` (``None`` when its data are missing) and writes a PNG
when ``path`` is given. :func:`render_report` draws whatever a report's sections allow.

Report sections read here:

* ``"history"``: ``[{"step": int, "b_simple": float|null, "ci_low": float|null, "ci_high": float|null,
  "b_simple_run": float|null}, ...]`` (``null`` ``b_simple``/``ci_high``: unbounded; ``b_simple_run``: the
  run average at that step, optional).
* ``"recommendation"``: :meth:`gns_callback.recommendation.Recommendation.to_dict`.
* ``"run_estimate"``/``"estimate"``: :meth:`gns_callback.GNSEstimate.to_dict` (when there is no recommendation).
* ``"probe"``: the probe's ``ProbeResult.to_dict()``: ``{"max_micro_batch", "fixed_bytes", "bytes_per_sample",
  "budget_bytes", "headroom"?, "throughput"?: [{"size", "samples_per_s"}], "trials": [...]}``, each trial a dict
  with ``size``, ``ok``, ``measured_bytes`` (or ``bytes``), ``samples_per_s`` (or ``samples_per_sec``), or a
  ``[size, ok, bytes, samples_per_sec]`` list.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

HISTORY_PNG = "gns_history.png"
TRADEOFF_PNG = "gns_tradeoff.png"
PROBE_PNG = "gns_probe.png"

_BLUE, _ORANGE, _GREEN, _GREY, _RED = "#1f77b4", "#ff7f0e", "#2ca02c", "#7f7f7f", "#d62728"


def _figure(width: float, height: float) -> "Figure":
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def _save(fig: "Figure", path: Optional[str | Path]) -> None:
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)


def _f(v: Any, missing: float = math.nan) -> float:
    """A report value as float: ``None`` → ``missing``."""
    if v is None:
        return missing
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _pos(v: float) -> bool:
    return math.isfinite(v) and v > 0


def _batch_label(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def _plain_log_ticks(axis: Any, top: float) -> None:
    """Readable ticks (1, 1.5, 2, 3, 5, 10, ...) on a log axis starting at 1, instead of powers of ten."""
    _fixed_ticks(axis, [t for t in (1, 1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500) if t <= top])


def _fixed_ticks(axis: Any, ticks: Sequence[float]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    axis.set_major_locator(FixedLocator(list(ticks)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(NullLocator())
    axis.set_minor_formatter(NullFormatter())


def _ticks_125(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks between ``lo`` and ``hi`` (for a log axis of batch sizes)."""
    out = []
    for e in range(math.floor(math.log10(max(lo, 1e-9))) - 1, math.ceil(math.log10(hi)) + 1):
        out += [m * 10.0**e for m in (1, 2, 5) if lo <= m * 10.0**e <= hi]
    return out


# ---------------------------------------------------------------------------------------------------------------
def plot_history(
    history: Sequence[Mapping[str, Any]],
    *,
    current_batch_size: Optional[float] = None,
    recommended_batch_size: Optional[float] = None,
    confidence: float = 0.95,
    path: Optional[str | Path] = None,
) -> Optional["Figure"]:
    """B_simple over training with its interval band (log scale), the run average, and the batch sizes."""
    rows = sorted((r for r in history or () if r.get("step") is not None), key=lambda r: r["step"])
    steps = [int(r["step"]) for r in rows]
    b = [_f(r.get("b_simple")) for r in rows]
    lo = [_f(r.get("ci_low")) for r in rows]
    hi = [_f(r.get("ci_high"), math.inf) for r in rows]
    run = [_f(r.get("b_simple_run")) for r in rows]
    finite = [v for v in b + lo + hi + run if _pos(v)]
    finite += [v for v in (current_batch_size, recommended_batch_size) if v is not None and _pos(float(v))]
    if not rows or not finite:
        return None
    y_min, y_max = min(finite) / 1.5, max(finite) * 1.5

    def clip(v: float) -> float:  # the band inside the axes: a missing/zero lower end or an unbounded upper end
        return min(max(v, y_min), y_max) if _pos(v) or math.isinf(v) else y_min

    fig = _figure(8, 4.5)
    ax = fig.add_subplot()
    level = round(100 * confidence)
    ax.fill_between(steps, [clip(v) for v in lo], [clip(v) for v in hi], color=_BLUE, alpha=0.2, linewidth=0,
                    label=f"{level}% interval")
    ax.plot(steps, [v if _pos(v) else math.nan for v in b], color=_BLUE, lw=1.8,
            marker="o" if len(rows) < 30 else None, ms=3, label="B_simple (recent, EMA)")
    if any(_pos(v) for v in run):
        ax.plot(steps, [v if _pos(v) else math.nan for v in run], color=_ORANGE, lw=1.5, ls="--",
                label="B_simple (run average)")
    if current_batch_size:
        ax.axhline(current_batch_size, color=_GREY, ls=":", lw=1.5, label=f"current batch {current_batch_size:g}")
    if recommended_batch_size:
        ax.axhline(recommended_batch_size, color=_GREEN, ls="-.", lw=1.5,
                   label=f"recommended batch {recommended_batch_size:g}")
    if any(math.isinf(v) for v in hi):
        ax.text(0.01, 0.98, "band clipped where the interval is unbounded above", transform=ax.transAxes,
                va="top", fontsize=8, color=_GREY)
    ax.set_yscale("log")
    ax.set_ylim(y_min, y_max)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("noise scale (examples)")
    ax.set_title("Gradient noise scale over training")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    _save(fig, path)
    return fig


# ---------------------------------------------------------------------------------------------------------------
def plot_tradeoff(
    b_noise: float,
    ci_low: float = math.nan,
    ci_high: float = math.nan,
    *,
    current_batch_size: Optional[float] = None,
    recommended_batch_size: Optional[float] = None,
    confidence: float = 0.95,
    path: Optional[str | Path] = None,
) -> Optional["Figure"]:
    """McCandlish et al.'s trade-off: ``(S/S_min − 1)(E/E_min − 1) = 1`` with the batches marked (left), and
    both factors against the batch size with bands for ``B_noise`` in the interval (right)."""
    import numpy as np

    from gns_callback.recommendation.tradeoff import examples_factor, steps_factor

    if not _pos(b_noise):
        return None
    fig = _figure(11, 4.6)
    ax, bx = fig.subplots(1, 2)
    level = round(100 * confidence)
    top = 40.0

    # Left: the hyperbola in normalised coordinates (the same curve for every B_noise).
    u = np.logspace(-2.5, 2.5, 400)  # B/B_noise
    ax.plot(1 + u, 1 + 1 / u, color="black", lw=1.2, label="(S/S_min − 1)(E/E_min − 1) = 1")
    ax.plot([2], [2], marker="o", ms=7, mfc="white", mec="black", ls="none", label="knee B = B_noise")
    for r in (0.125, 0.25, 0.5, 2, 4, 8):
        ax.annotate(f"B≈{_batch_label(r * b_noise)}", (1 + r, 1 + 1 / r), textcoords="offset points", xytext=(4, 4),
                    fontsize=7, color=_GREY)
        ax.plot([1 + r], [1 + 1 / r], marker=".", color=_GREY, ls="none")
    for batch, color, name in ((current_batch_size, _GREY, "current"), (recommended_batch_size, _GREEN, "recommended")):
        if not batch:
            continue
        # The interval moves the point along the same curve: u between B/ci_high and B/ci_low.
        u_lo = batch / ci_high if _pos(ci_high) else 1e-3
        u_hi = batch / ci_low if _pos(ci_low) else 1e3
        if u_lo < u_hi:
            seg = np.logspace(math.log10(u_lo), math.log10(u_hi), 100)
            ax.plot(1 + seg, 1 + 1 / seg, color=color, lw=7, alpha=0.3, solid_capstyle="round")
        ub = batch / b_noise
        ax.plot([1 + ub], [1 + 1 / ub], marker="D" if name == "current" else "*", ms=9 if name == "current" else 14,
                color=color, mec="black", ls="none", label=f"{name} B = {batch:g} (band: {level}% interval)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1, top)
    ax.set_ylim(1, top)
    ax.set_xlabel("E/E_min  (examples processed, relative)")
    ax.set_ylabel("S/S_min  (optimizer steps, relative)")
    ax.set_title(f"Steps vs examples to reach the same loss (B_noise ≈ {b_noise:.3g})", fontsize=10)
    _plain_log_ticks(ax.xaxis, top)
    _plain_log_ticks(ax.yaxis, top)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")

    # Right: factors against the batch size.
    marks = [v for v in (current_batch_size, recommended_batch_size, ci_low, ci_high, b_noise) if v and _pos(v)]
    bmin, bmax = min(marks + [b_noise]) / 4, max(marks + [b_noise]) * 4
    bs = np.logspace(math.log10(max(bmin, 1e-3)), math.log10(bmax), 300)
    sf = [steps_factor(x, b_noise) for x in bs]
    ef = [examples_factor(x, b_noise) for x in bs]
    bx.plot(bs, sf, color=_BLUE, lw=1.8, label="S/S_min = 1 + B_noise/B (steps)")
    bx.plot(bs, ef, color=_ORANGE, lw=1.8, label="E/E_min = 1 + B/B_noise (examples)")
    if _pos(ci_low) or _pos(ci_high):
        lo_n = ci_low if _pos(ci_low) else b_noise
        hi_n = ci_high if _pos(ci_high) else math.inf
        s_lo = [steps_factor(x, lo_n) for x in bs]
        s_hi = [min(steps_factor(x, hi_n), 2 * top) for x in bs]
        e_lo = [examples_factor(x, hi_n) for x in bs]
        e_hi = [min(examples_factor(x, lo_n), 2 * top) for x in bs]
        bx.fill_between(bs, s_lo, s_hi, color=_BLUE, alpha=0.15, linewidth=0)
        bx.fill_between(bs, e_lo, e_hi, color=_ORANGE, alpha=0.15, linewidth=0, label=f"{level}% interval of B_noise")
    bx.axvline(b_noise, color="black", lw=0.8, ls="--", label="B_simple")
    if current_batch_size:
        bx.axvline(current_batch_size, color=_GREY, lw=1.5, ls=":", label=f"current {current_batch_size:g}")
    if recommended_batch_size:
        bx.axvline(recommended_batch_size, color=_GREEN, lw=1.5, ls="-.",
                   label=f"recommended {recommended_batch_size:g}")
    bx.axhline(2, color="black", lw=0.5, alpha=0.5)
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_ylim(1, 2 * top)
    bx.set_xlim(bs[0], bs[-1])
    _plain_log_ticks(bx.yaxis, 2 * top)
    _fixed_ticks(bx.xaxis, _ticks_125(bs[0], bs[-1]))
    bx.set_xlabel("global batch size B")
    bx.set_ylabel("factor over the minimum")
    unbounded = "" if _pos(ci_high) else " (interval unbounded above)"
    bx.set_title(f"Cost of a batch size: steps and examples{unbounded}", fontsize=10)
    bx.grid(True, which="both", alpha=0.25)
    bx.legend(fontsize=8, loc="upper center", ncols=2)
    _save(fig, path)
    return fig


# ---------------------------------------------------------------------------------------------------------------
def plot_probe(
    probe: Mapping[str, Any] | Any, *, chosen_micro_batch: Optional[int] = None, path: Optional[str | Path] = None
) -> Optional["Figure"]:
    """The probe: measured memory per trial with the fitted line, budget and predicted maximum (left), and
    throughput per micro-batch size (right)."""
    import numpy as np

    from gns_callback.recommendation.sizing import _get, parse_trial, probe_throughput

    if probe is None:
        return None
    trials = [t for t in map(parse_trial, _get(probe, "trials") or ()) if (t.split or 1) == 1]
    fixed, per, budget = (_f(_get(probe, k)) for k in ("fixed_bytes", "bytes_per_sample", "budget_bytes"))
    headroom = _f(_get(probe, "headroom"), 1.0)
    max_micro = _get(probe, "max_micro_batch")
    mem = [t for t in trials if t.bytes is not None and math.isfinite(t.bytes)]
    table = probe_throughput(probe)
    has_fit = math.isfinite(fixed) and math.isfinite(per)
    if not (mem or has_fit or table):
        return None
    fig = _figure(11, 4.4)
    ax, bx = fig.subplots(1, 2)

    scale_ref = max([t.bytes for t in mem] + ([budget] if _pos(budget) else []) + [1.0])
    unit, div = ("GiB", 2**30) if scale_ref >= 2**30 else ("MiB", 2**20)
    sizes = [t.size for t in trials] + ([max_micro] if max_micro else []) + list(table)
    x_max = max(sizes + [1]) * 1.15
    if has_fit:
        xs = np.linspace(0, x_max, 100)
        ax.plot(xs, (fixed + per * xs) / div, color=_BLUE, lw=1.5,
                label=f"fit: {fixed / div:.3g} {unit} + {per / 2**20:.3g} MiB/sample")
    ok = [t for t in mem if t.ok]
    bad = [t for t in mem if not t.ok]
    if ok:
        ax.plot([t.size for t in ok], [t.bytes / div for t in ok], "o", color=_BLUE, mec="black",
                label="measured (fits)")
    if bad:
        ax.plot([t.size for t in bad], [t.bytes / div for t in bad], "x", color=_RED, ms=9, mew=2,
                label="over the limit")
    oom_no_bytes = [t for t in trials if not t.ok and (t.bytes is None or not math.isfinite(t.bytes))]
    if oom_no_bytes and _pos(budget):
        ax.plot([t.size for t in oom_no_bytes], [budget / div] * len(oom_no_bytes), "x", color=_RED, ms=9, mew=2,
                label="out of memory (drawn at the budget)")
    if _pos(budget):
        ax.axhline(budget / div, color=_RED, ls="--", lw=1.2, label=f"budget {budget / div:.3g} {unit}")
        if 0 < headroom < 1:
            ax.axhline(headroom * budget / div, color=_RED, ls=":", lw=1.2,
                       label=f"usable: {headroom:g} × budget")
    if max_micro:
        ax.axvline(max_micro, color=_GREEN, ls="-.", lw=1.5, label=f"max micro-batch that fits: {max_micro}")
    ax.set_xlim(0, x_max)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("micro-batch size (per device)")
    ax.set_ylabel(f"peak memory ({unit})")
    ax.set_title("Memory per micro-batch size", fontsize=10)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left")
    if not (mem or has_fit):
        ax.text(0.5, 0.5, "no memory measured", ha="center", va="center", transform=ax.transAxes, color=_GREY)

    if table:
        from gns_callback.recommendation.tradeoff import throughput_at

        xs = sorted(table)
        bx.plot(xs, [table[x] for x in xs], "o-", color=_ORANGE, mec="black", label="measured")
        fits = [x for x in xs if not max_micro or x <= max_micro] or xs
        chosen = chosen_micro_batch or max(fits, key=lambda x: (table[x], x))
        label = f"recommended micro-batch: {chosen}" if chosen_micro_batch else f"fastest that fits: {chosen}"
        bx.plot([chosen], [throughput_at(table, chosen)], "*", ms=15, color=_GREEN, mec="black", label=label)
        bx.set_xscale("log", base=2)
        bx.set_xticks(xs, [str(x) for x in xs])
        bx.minorticks_off()
        bx.set_ylim(bottom=0, top=max(table.values()) * 1.15)
        bx.legend(fontsize=8, loc="lower right")
    else:
        bx.text(0.5, 0.5, "no throughput measured", ha="center", va="center", transform=bx.transAxes, color=_GREY)
    bx.set_xlabel("micro-batch size (per device)")
    bx.set_ylabel("samples / s (per device)")
    bx.set_title("Throughput per micro-batch size", fontsize=10)
    bx.grid(True, alpha=0.3)
    _save(fig, path)
    return fig


# ---------------------------------------------------------------------------------------------------------------
def render_report(report: Mapping[str, Any], out_dir: str | Path, *, recommendation: Any = None) -> dict[str, Path]:
    """Write the PNGs that ``report``'s sections allow into ``out_dir``; returns ``{name: path}``.

    ``recommendation`` (a :class:`Recommendation`) overrides the report's ``"recommendation"`` section.
    """
    out = Path(out_dir)
    written: dict[str, Path] = {}
    rec = recommendation
    if rec is None and report.get("recommendation"):
        from gns_callback.recommendation import Recommendation

        try:
            rec = Recommendation.from_dict(report["recommendation"])
        except (KeyError, TypeError):
            rec = None
    cur = rec.current.batch_size if rec is not None else None
    new = rec.batch_size if rec is not None else None
    est = report.get("run_estimate") or report.get("estimate") or {}
    conf = _f(est.get("confidence"), 0.95) if est else 0.95

    if report.get("history"):
        fig = plot_history(report["history"], current_batch_size=cur, recommended_batch_size=new, confidence=conf,
                           path=out / HISTORY_PNG)
        if fig is not None:
            written["history"] = out / HISTORY_PNG

    if rec is not None:
        args = (rec.b_noise, rec.ci_low, rec.ci_high)
        conf = rec.confidence
    elif est:
        args = (_f(est.get("b_simple")), _f(est.get("ci_low")), _f(est.get("ci_high"), math.inf))
    else:
        args = None
    if args is not None:
        fig = plot_tradeoff(*args, current_batch_size=cur, recommended_batch_size=new, confidence=conf,
                            path=out / TRADEOFF_PNG)
        if fig is not None:
            written["tradeoff"] = out / TRADEOFF_PNG

    if report.get("probe"):
        chosen = rec.micro_batch_size if rec is not None else None
        fig = plot_probe(report["probe"], chosen_micro_batch=chosen, path=out / PROBE_PNG)
        if fig is not None:
            written["probe"] = out / PROBE_PNG
    return written
