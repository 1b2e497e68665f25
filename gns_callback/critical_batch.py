"""The critical batch size of a training run, read off its noise scale as a function of the loss.

McCandlish, Kaplan, Amodei 2018 ("An Empirical Model of Large-Batch Training", section 2.2 and appendix D):
a step at batch ``B`` makes ``1/(1 + B_t/B)`` of a noise-free step's progress, so along a run
``S_min = Σ_t 1/(1 + B_t/B)``, ``E_min = Σ_t B_t/(1 + B_t/B)`` and ``B_crit = E_min/S_min`` is a
progress-weighted mean of the per-step noise scale ``B_t = tr Σ_t/|G_t|²``. That model is independent of the
measuring batch, but measured along SGD runs on real data (``benchmarks/critical_batch_summary.py``) it
overshoots the slow-way ``B_crit`` by 2–10×, and so do the other averages over *steps*:

* per step, ``|G_t|²`` swings by 10–100× (catapult spikes, edge-of-stability oscillation): a ratio of
  cumulative sums ``Σ tr Σ_t/Σ |G_t|²`` is decided by a few spikes and by the initialisation transient, and
  an average of ``B_t`` over steps by the long quiet stretches late in training;
* steps are the wrong clock: a run at batch 512 finishes in a fifth of the steps of a run at batch 8.

What *is* shared by runs at different batch sizes is the loss range they traverse. Binned by the loss, the
windowed noise scale ``B(L) = Σ_{t∈L} tr Σ_t / Σ_{t∈L} |G_t|²`` is nearly the same function along runs at
batch 8 … 512, in the early and middle part of training; it grows roughly as a power of ``1/L`` (10–30×
over the run). The exceptions are the two ends: the initialisation transient (``|G|²`` explodes, ``B(L)``
far below ``B_crit``) and the last stretch, where ``B(L)`` depends on the measuring run (its own noise floor
at small batch, a quiet path at large batch). Measured against ``B_crit`` per loss window, the local
critical batch stays flat while ``B(L)`` climbs, and ``B_crit`` of the whole run sits at ``B(L)`` near the
middle of the log-loss range. Hence the estimate:

    B_crit ≈ ( B(window 1) · … · B(window K) )^(1/K)

over ``K`` equal windows of ``log L`` covering the middle ``1 − 2·trim`` of the run's log-loss range
``[log L_end, log L_start]`` (defaults ``K = 2``, ``trim = 1/4``: the two central quarters). For a power law
``B(L) ∝ L^(−α)`` this is ``B`` at the geometric mid-loss ``√(L_start·L_end)``. Each window is a ratio of means,
so it carries a Fieller interval (:mod:`gns_callback.confidence`); the geometric mean's interval adds the
windows' log half-widths in quadrature. The measured accuracy against the slow-way ``B_crit`` (model error,
beyond this statistical interval) is :data:`MODEL_FACTOR`; :attr:`CriticalBatchEstimate.trust_low` and
``trust_high`` widen the interval by it.

The loss coordinate of a step is the running minimum of an EMA of the training loss (first passage, so a loss
spike does not move a step back to an earlier window), kept in fine bins of ``log L``. Needs a positive loss
that falls by at least :data:`MIN_LOSS_FALL` over the run; otherwise the estimate is the plain run average
``Σ tr Σ/Σ |G|²`` and ``method`` says why. Pure torch/Python: no Lightning.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch

from gns_callback.json_values import json_safe
from gns_callback.smoothing import SUM_FIELDS, RatioSummary, step_vector, summarize_ratio

#: Width of the fine bins of log-loss depth (the windows are assembled from them at read time).
BIN_WIDTH = math.log(2.0) / 8
#: Fine bins kept: depth up to ``BINS·BIN_WIDTH`` (a loss fall of 2^64); deeper steps share the last bin.
BINS = 512
#: Below this loss fall (L_start/L_end) the loss windows are not resolved and the run average is used.
MIN_LOSS_FALL = 2.0
#: Measured model error: on the benchmark's runs (every batch 8…512, seeds, two models, plain SGD) the estimate
#: lay within this factor of the slow-way B_crit (benchmarks/RESULTS.md, "Critical batch from one run").
MODEL_FACTOR = 2.0

LOSS_WINDOWS = "log-loss midpoint"
RUN_AVERAGE = "run average"


@dataclass(frozen=True)
class CriticalBatchEstimate:
    """``b_crit`` with its statistical interval (``ci_low``, ``ci_high``) and what it was read from.

    ``window_values``: the noise scale in each loss window; ``loss_start``/``loss_end``: the smoothed loss range
    of the run; ``method``: :data:`LOSS_WINDOWS` or :data:`RUN_AVERAGE` (with the reason). ``trust_low`` /
    ``trust_high`` add the measured model error :data:`MODEL_FACTOR` to the interval: how far to trust it.
    """

    b_crit: float
    ci_low: float
    ci_high: float
    confidence: float
    window_values: tuple[float, ...]
    loss_start: float
    loss_end: float
    steps: int
    method: str

    @property
    def trust_low(self) -> float:
        return self.ci_low / MODEL_FACTOR

    @property
    def trust_high(self) -> float:
        return self.ci_high * MODEL_FACTOR

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats become ``None``), trust bounds included."""
        return json_safe({**asdict(self), "trust_low": self.trust_low, "trust_high": self.trust_high})

    def __str__(self) -> str:
        level = round(100 * self.confidence)
        return (f"B_crit ≈ {self.b_crit:.4g} ({level}% CI {self.ci_low:.4g} – {self.ci_high:.4g}; with the model "
                f"error ×{MODEL_FACTOR:g}: {self.trust_low:.4g} – {self.trust_high:.4g}; {self.method}, loss "
                f"{self.loss_start:.3g} → {self.loss_end:.3g}, {self.steps} steps)")


# ------------------------------------------------------------------------------------------- combining windows
def geometric_mean_interval(windows: Sequence[RatioSummary]) -> tuple[float, float, float]:
    """``(G, low, high)``: ``G = (Π R_k)^(1/K)`` of the windows' ratios; the interval adds their log half-widths
    ``log R_k − log low_k`` and ``log high_k − log R_k`` in quadrature, divided by ``K`` (independent windows)."""
    ratios = [w.ratio for w in windows]
    if any(not (0.0 < r < math.inf) for r in ratios):  # a window unresolved (ratio 0, inf or nan)
        g = 0.0 if any(r == 0.0 for r in ratios) else math.inf if any(r == math.inf for r in ratios) else math.nan
        return g, 0.0, math.inf
    k = len(ratios)
    log_g = sum(math.log(r) for r in ratios) / k
    below = math.sqrt(sum(_log_gap(w.ratio, w.ci_low) ** 2 for w in windows)) / k
    above = math.sqrt(sum(_log_gap(w.ci_high, w.ratio) ** 2 for w in windows)) / k
    return math.exp(log_g), math.exp(log_g - below), math.exp(log_g + above)


def _log_gap(upper: float, lower: float) -> float:
    return math.log(upper / lower) if lower > 0.0 and upper < math.inf else math.inf


# ------------------------------------------------------------------------------------------- windows from bins
def window_edges(depth: float, windows: int, trim: float) -> list[tuple[float, float]]:
    """``[lo, hi)`` in log-loss depth (``log L_start − log L``) of ``windows`` equal windows covering the middle
    ``1 − 2·trim`` of ``[0, depth]``."""
    span = depth * (1.0 - 2.0 * trim)
    return [(depth * trim + span * k / windows, depth * trim + span * (k + 1) / windows) for k in range(windows)]


def window_sums(bin_sums: torch.Tensor, edges: Sequence[tuple[float, float]], bin_width: float) -> list[list[float]]:
    """Sum the fine bins (rows of ``bin_sums``, ``SUM_FIELDS`` order) whose centre falls in each window."""
    centres = (torch.arange(bin_sums.shape[0], dtype=torch.float64) + 0.5) * bin_width
    out = []
    for k, (lo, hi) in enumerate(edges):
        last = k == len(edges) - 1
        inside = (centres >= lo) & ((centres <= hi) if last else (centres < hi))
        out.append(bin_sums[inside].sum(0).tolist())
    return out


def summarize_bins(bin_sums: torch.Tensor, loss_start: float, loss_end: float, *, windows: int = 2,
                   trim: float = 0.25, bin_width: float = BIN_WIDTH, confidence: float = 0.95,
                   loss_positive: bool = True) -> CriticalBatchEstimate:
    """The estimate from per-bin sums (``(bins, 7)``, ``SUM_FIELDS`` order) and the smoothed loss range."""
    bin_sums = bin_sums.detach().to("cpu", torch.float64)
    steps = int(round(float(bin_sums[:, 0].sum())))
    reason = _run_average_reason(loss_start, loss_end, loss_positive)
    if reason is None:
        edges = window_edges(math.log(loss_start / loss_end), windows, trim)
        parts = [summarize_ratio(s, confidence) for s in window_sums(bin_sums, edges, bin_width)]
        if all(p.effective_steps > 1.0 for p in parts):
            g, low, high = geometric_mean_interval(parts)
            values = tuple(p.ratio for p in parts)
            return CriticalBatchEstimate(g, low, high, confidence, values, loss_start, loss_end, steps, LOSS_WINDOWS)
        reason = "a loss window holds fewer than 2 steps"
    whole = summarize_ratio(bin_sums.sum(0).tolist(), confidence)
    return CriticalBatchEstimate(whole.ratio, whole.ci_low, whole.ci_high, confidence, (whole.ratio,), loss_start,
                                 loss_end, steps, f"{RUN_AVERAGE} ({reason})")


def _run_average_reason(loss_start: float, loss_end: float, loss_positive: bool) -> str | None:
    if not loss_positive:
        return "the loss was not positive, so it has no log scale"
    if not (math.isfinite(loss_start) and math.isfinite(loss_end)):
        return "no loss measured"
    if loss_start < MIN_LOSS_FALL * loss_end:
        return f"the loss fell by less than {MIN_LOSS_FALL:g}× ({loss_start:.3g} → {loss_end:.3g})"
    return None


# ------------------------------------------------------------------------------------------- online accumulator
def _check_options(windows: int, trim: float, loss_decay: float) -> None:
    if not (isinstance(windows, int) and windows >= 1):
        raise ValueError(f"windows must be an integer >= 1 (the number of log-loss windows), got {windows!r}")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5) (the fraction of the log-loss range left out at each end), "
                         f"got {trim!r}")
    if not 0.0 <= loss_decay < 1.0:
        raise ValueError(f"loss_decay must be in [0, 1) (EMA decay of the training loss), got {loss_decay!r}")


class CriticalBatchAccumulator:
    """Per-step ``(tr Σ̂, |Ĝ|², loss)`` binned by log-loss depth, kept on the device (no host sync per update).

    ``update(trace, grad_sq, loss, valid)`` takes 0-d tensors: the step's unbiased estimates (the same pair the
    run-average :class:`~gns_callback.smoothing.RatioAccumulator` gets) and its mean training loss. A step
    with ``valid == False`` changes nothing. ``loss_decay`` smooths the loss (bias-corrected EMA) before its
    running minimum places the step.
    """

    def __init__(self, windows: int = 2, trim: float = 0.25, loss_decay: float = 0.9, bins: int = BINS,
                 bin_width: float = BIN_WIDTH) -> None:
        _check_options(windows, trim, loss_decay)
        self.windows, self.trim, self.loss_decay = int(windows), float(trim), float(loss_decay)
        self.bin_width = float(bin_width)
        self.bin_sums = torch.zeros(bins, len(SUM_FIELDS), dtype=torch.float64)
        # [EMA numerator, EMA weight, log L_start, running min of log L, non-positive loss seen (0/1)]
        self.loss_state = torch.tensor([0.0, 0.0, math.nan, math.inf, 0.0], dtype=torch.float64)

    def update(self, trace: torch.Tensor, grad_sq: torch.Tensor, loss: torch.Tensor, valid: torch.Tensor) -> None:
        """Add one step (device tensors; no ``.item()``)."""
        step = step_vector(trace, grad_sq)
        self._to(step.device)
        loss = loss.detach().to(torch.float64)
        valid = valid & torch.isfinite(loss)
        new_state = self._next_loss_state(loss)
        self.loss_state = torch.where(valid, new_state, self.loss_state)
        depth = torch.nan_to_num(self.loss_state[2] - self.loss_state[3], nan=0.0).clamp_min(0.0)  # nan: no loss yet
        index = torch.floor(depth / self.bin_width).clamp(0, self.bin_sums.shape[0] - 1).long()
        row = torch.where(valid, step, torch.zeros_like(step))  # where() picks: a non-finite step never leaks
        self.bin_sums.index_add_(0, index.view(1), row.view(1, -1))

    def _next_loss_state(self, loss: torch.Tensor) -> torch.Tensor:
        num, weight, start, low, nonpositive = self.loss_state.unbind()
        num, weight = self.loss_decay * num + loss, self.loss_decay * weight + 1.0
        smoothed = num / weight
        log_loss = torch.log(smoothed.clamp_min(torch.finfo(torch.float64).tiny))
        start = torch.where(torch.isnan(start), log_loss, start)
        low = torch.minimum(low, log_loss)
        nonpositive = torch.maximum(nonpositive, (smoothed <= 0).to(torch.float64))
        return torch.stack([num, weight, start, low, nonpositive])

    def _to(self, device: torch.device) -> None:
        if self.bin_sums.device != device:
            self.bin_sums = self.bin_sums.to(device)
            self.loss_state = self.loss_state.to(device)

    def summary(self, confidence: float = 0.95) -> CriticalBatchEstimate:
        """Read the estimate (one device-to-host copy of the bins)."""
        _, _, start, low, nonpositive = self.loss_state.tolist()
        return summarize_bins(self.bin_sums, math.exp(start), math.exp(low), windows=self.windows, trim=self.trim,
                              bin_width=self.bin_width, confidence=confidence, loss_positive=nonpositive == 0.0)

    def state_dict(self) -> dict:
        return {"windows": self.windows, "trim": self.trim, "loss_decay": self.loss_decay,
                "bin_width": self.bin_width, "bin_sums": self.bin_sums.tolist(), "loss_state": self.loss_state.tolist()}

    def load_state_dict(self, state: dict) -> None:
        device = self.bin_sums.device
        self.windows, self.trim = int(state["windows"]), float(state["trim"])
        self.loss_decay, self.bin_width = float(state["loss_decay"]), float(state["bin_width"])
        self.bin_sums = torch.tensor(state["bin_sums"], dtype=torch.float64, device=device)
        self.loss_state = torch.tensor(state["loss_state"], dtype=torch.float64, device=device)


def critical_batch_size(trace: Sequence[float] | torch.Tensor | np.ndarray,
                        grad_sq: Sequence[float] | torch.Tensor | np.ndarray,
                        loss: Sequence[float] | torch.Tensor | np.ndarray, *, confidence: float = 0.95,
                        windows: int = 2, trim: float = 0.25, loss_decay: float = 0.9, bins: int = BINS,
                        bin_width: float = BIN_WIDTH) -> CriticalBatchEstimate:
    """The estimate from per-step arrays of equal length: unbiased ``tr Σ̂_t`` and ``|Ĝ_t|²`` estimates and the
    step's mean training loss. Steps with a non-finite entry are skipped. Same result as feeding the steps to
    :class:`CriticalBatchAccumulator` one by one (vectorised here)."""
    _check_options(windows, trim, loss_decay)
    x, y, l = (np.asarray(torch.as_tensor(v, dtype=torch.float64).cpu(), dtype=np.float64).reshape(-1)
               for v in (trace, grad_sq, loss))
    if not len(x) == len(y) == len(l):
        raise ValueError(f"trace, grad_sq and loss must have the same length, got {len(x)}, {len(y)}, {len(l)}")
    ok = np.isfinite(x) & np.isfinite(y) & np.isfinite(l)
    x, y, l = x[ok], y[ok], l[ok]
    smoothed = _bias_corrected_ema(l, loss_decay)
    if len(l) == 0 or (smoothed <= 0).any():
        bin_sums = torch.zeros(bins, len(SUM_FIELDS), dtype=torch.float64)
        bin_sums[0] = torch.tensor(_column_sums(x, y))
        start = end = float(smoothed[0]) if len(l) else math.nan
        return summarize_bins(bin_sums, start, end, windows=windows, trim=trim, bin_width=bin_width,
                              confidence=confidence, loss_positive=len(l) == 0 or bool((smoothed > 0).all()))
    log_loss = np.log(smoothed)
    depth = log_loss[0] - np.minimum.accumulate(log_loss)
    index = np.clip(np.floor(depth / bin_width), 0, bins - 1).astype(np.int64)
    rows = np.stack([np.ones_like(x), np.ones_like(x), x, y, x * x, y * y, x * y], axis=1)
    bin_sums = np.zeros((bins, len(SUM_FIELDS)))
    np.add.at(bin_sums, index, rows)
    return summarize_bins(torch.from_numpy(bin_sums), float(smoothed[0]), float(np.exp(log_loss.min())),
                          windows=windows, trim=trim, bin_width=bin_width, confidence=confidence)


def _bias_corrected_ema(values: np.ndarray, decay: float) -> np.ndarray:
    out, num, weight = np.empty_like(values), 0.0, 0.0
    for i, v in enumerate(values):
        num, weight = decay * num + v, decay * weight + 1.0
        out[i] = num / weight
    return out


def _column_sums(x: np.ndarray, y: np.ndarray) -> list[float]:
    n = float(len(x))
    return [n, n, x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()]
