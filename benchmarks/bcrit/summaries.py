"""Candidate one-run summaries of the noise scale, each a function of one recorded run.

The *engine* candidates use only what the callback sees per optimizer step: the unbiased per-example estimates
``tr Σ̂_t`` and ``|Ĝ_t|²`` (small batch b = 1 over the measured examples, big batch = the step's batch), the
batch-gradient squared norm ``|G_B,t|²`` and the step's mean training loss. The *exact* references use
``|G_t|²`` and ``tr Σ_t`` over the whole training set at the step's parameters (measured every few steps).
"""

from __future__ import annotations

import math
import numpy as np

from benchmarks.bcrit.training import Trace
from gns_callback.critical_batch import critical_batch_size
from gns_callback.estimators import grad_sq_norm_estimate, trace_sigma_estimate


def engine_estimates(trace: Trace, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-step ``(tr Σ̂, |Ĝ|²)`` from the per-example norms (b = 1) and the batch gradient (B)."""
    x = trace_sigma_estimate(trace.small_sq, trace.big_sq, 1.0, float(batch_size))
    y = grad_sq_norm_estimate(trace.small_sq, trace.big_sq, 1.0, float(batch_size))
    return x, y


def previous_ema(values: np.ndarray, decay: float) -> np.ndarray:
    """Bias-corrected EMA of the *previous* steps (the first step uses itself): independent of step ``t``'s noise."""
    out, num, weight = np.empty_like(values), 0.0, 0.0
    for i, v in enumerate(values):
        out[i] = num / weight if weight > 0 else v
        num, weight = decay * num + v, decay * weight + 1.0
    return out


def ratio_of_sums(x: np.ndarray, y: np.ndarray) -> float:
    return float(x.sum() / y.sum()) if y.sum() > 0 else math.inf


def progress_weighted(x: np.ndarray, y: np.ndarray, norm: np.ndarray) -> float:
    """The lead's candidate ``Σ (x_t/n_t) / Σ (y_t/n_t)`` with ``n_t ≈ E|G_B,t|²`` (McCandlish's S_min-weighting)."""
    return ratio_of_sums(x / norm, y / norm)


def ema_at(x: np.ndarray, y: np.ndarray, fraction: float, decay: float = 0.99) -> float:
    """The callback's EMA estimate (bias-corrected, ``decay``) read after ``fraction`` of the run's steps."""
    n = max(1, int(round(fraction * len(x))))
    w = decay ** np.arange(n)[::-1]
    return ratio_of_sums(w * x[:n], w * y[:n])


def engine_summaries(trace: Trace, batch_size: int) -> dict[str, float]:
    """Every engine candidate on one run (keys are the table's row names)."""
    x, y = engine_estimates(trace, batch_size)
    half = len(x) // 2
    n_prev = previous_ema(trace.big_sq, 0.9)
    return {
        "ratio of sums (current run average)": ratio_of_sums(x, y),
        "progress-weighted Σ(x/n)/Σ(y/n), n = EMA of |G_B|²": progress_weighted(x, y, n_prev),
        "late half: ratio of sums over the last 50% of steps": ratio_of_sums(x[half:], y[half:]),
        "EMA (decay 0.99) at 25% of the run": ema_at(x, y, 0.25),
        "EMA (decay 0.99) at 50% of the run": ema_at(x, y, 0.5),
        "harmonic: Σ(x/x̄)/Σ(y/x̄), x̄ = EMA of tr Σ̂": ratio_of_sums(x / previous_ema(x, 0.9).clip(1e-12),
                                                                     y / previous_ema(x, 0.9).clip(1e-12)),
        "log-loss windows: geometric mean over 4 windows, whole range": critical_batch_size(
            x, y, trace.batch_loss, windows=4, trim=0.0).b_crit,
        CHOSEN: critical_batch_size(x, y, trace.batch_loss).b_crit,
    }


CHOSEN = "log-loss midpoint: geometric mean over the 2 middle quarters (chosen)"


def exact_summaries(trace: Trace, batch_size: int) -> dict[str, float]:
    """References from the exact per-step values (NaN-free steps only)."""
    ok = np.isfinite(trace.exact_grad_sq)
    if not ok.any():
        return {}
    g, s = trace.exact_grad_sq[ok], trace.exact_trace[ok]
    per_step = s / g
    norm = g + s / batch_size
    return {
        "exact: ratio of sums": ratio_of_sums(s, g),
        "exact: progress-weighted (lead's formula)": progress_weighted(s, g, norm),
        "exact: mean of per-step B_t": float(per_step.mean()),
        "exact: median of per-step B_t": float(np.median(per_step)),
    }

