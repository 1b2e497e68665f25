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
at small batch, a quiet path at large batch). ``B_crit`` of the whole run sits near ``B(L)`` at the middle of
the log-loss range. Hence the estimate:

    B_crit ≈ ( B(window 1) · … · B(window K) )^(1/K)

over ``K`` equal windows of ``log L`` covering the middle ``1 − 2·trim`` of the run's log-loss range
``[log L_end, log L_start]`` (defaults ``K = 2``, ``trim = 1/4``: the two central quarters). For a power law
``B(L) ∝ L^(−α)`` this is ``B`` at the geometric mid-loss ``√(L_start·L_end)``. Each window is a ratio of means,
so it carries a Fieller interval (:mod:`gns_callback.confidence`); the geometric mean's interval adds the
windows' log half-widths in quadrature. The measured accuracy against the slow-way ``B_crit`` (model error,
beyond this statistical interval) is :data:`MODEL_FACTOR`; :attr:`CriticalBatchEstimate.trust_low` and
``trust_high`` widen the interval by it.

The loss coordinate: steps are summed into consecutive blocks (at most :data:`BLOCKS`; a block's size doubles as
the run grows); when read, each block's mean training loss is smoothed in ``log L`` over ``±``:data:`SMOOTHING`
neighbouring blocks (centred, so short runs at large batch are not shifted by a lagging average) and placed by
the running minimum (first passage: a loss spike does not move steps back to an earlier window). Only loss
*ratios* matter, so a constant factor in the loss (``1/accumulate_grad_batches``, a sum reduction) changes
nothing. Needs a positive loss that falls by at least :data:`MIN_LOSS_FALL` over the run; otherwise the estimate
is the plain run average ``Σ tr Σ/Σ |G|²`` and ``method`` says why. Pure torch/numpy: no Lightning.

Calibrated for plain SGD. The gradient noise cannot see the optimizer: with momentum 0.9 on the same MLP the
slow-way ``B_crit`` was ~15× the plain-SGD one (about the same ``E_min``, a 12× smaller ``S_min``), 4–16× this
estimate (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from gns_callback.json_values import json_safe
from gns_callback.smoothing import SUM_FIELDS, RatioSummary, full_sums, moment_columns, step_vector, summarize_ratio

#: Steps are kept in at most this many consecutive blocks (merged pairwise as the run grows: a power-of-two size).
BLOCKS = 256
#: The blocks' mean losses are smoothed over this many neighbouring blocks on each side (centred: no lag).
SMOOTHING = 2
#: Below this loss fall (L_start/L_end) the loss windows are not resolved and the run average is used.
MIN_LOSS_FALL = 2.0
#: Measured model error: on the benchmark's runs (plain SGD, every batch 8…512, 6 seeds, two models) the estimate
#: lay within this factor of the slow-way B_crit in 82 of 84 runs (worst 2.6×), and the statistical interval
#: widened by it contained B_crit in all 84 (benchmarks/RESULTS.md, "Critical batch from one run"). On a data set
#: held out from that choice (breast cancer, 21 runs) the estimate lay within ×2 in 11, its statistical interval
#: (wide there: few steps per window) held B_crit in 19 and the widened one in all 21.
MODEL_FACTOR = 2.0
#: Columns of a block: the ``SUM_FIELDS`` sums of (tr Σ̂, |Ĝ|²), then the sum of the steps' losses.
BLOCK_FIELDS = (*SUM_FIELDS, "loss")
_SUMS = len(SUM_FIELDS)

LOSS_WINDOWS = "log-loss midpoint"
RUN_AVERAGE = "run average"


@dataclass(frozen=True)
class CriticalBatchEstimate:
    """``b_crit`` with its statistical interval (``ci_low``, ``ci_high``) and what it was read from.

    ``window_values``: the noise scale in each loss window; ``loss_start``/``loss_end``: the smoothed loss range
    of the run; ``method``: :data:`LOSS_WINDOWS` or :data:`RUN_AVERAGE` (with the reason). ``trust_low`` /
    ``trust_high`` add the measured model error :data:`MODEL_FACTOR` to the interval: how far to trust it.
    ``early_noise_scale``: ``Σ tr Σ̂/Σ |Ĝ|²`` over the first ``trim`` of the log-loss range (``nan`` when not
    resolved): the noise scale of the phase that limits a constant SGD learning rate (see :func:`early_window`);
    ``early_noise_scale_low`` the lower end of its interval (at ``confidence``), what an SGD LR *increase* uses.
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
    early_noise_scale: float = math.nan
    early_noise_scale_low: float = math.nan

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
        if math.isnan(self.b_crit):  # before: "B_crit ≈ nan (95% CI nan – nan; ..."
            why = "no optimizer step measured" if not self.steps else self.method
            return f"B_crit {why if why.startswith('not measured') else f'not measured ({why})'}, {self.steps} steps"
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


# ------------------------------------------------------------------------------------------- windows from blocks
def window_edges(depth: float, windows: int, trim: float) -> list[tuple[float, float]]:
    """``[lo, hi)`` in log-loss depth (``log L_start − log L``) of ``windows`` equal windows covering the middle
    ``1 − 2·trim`` of ``[0, depth]`` (the last one closed)."""
    span = depth * (1.0 - 2.0 * trim)
    return [(depth * trim + span * k / windows, depth * trim + span * (k + 1) / windows) for k in range(windows)]


def smoothed_log_loss(blocks: torch.Tensor, smoothing: int = SMOOTHING) -> torch.Tensor:
    """``log`` of each (non-empty) block's mean loss, averaged over ``±smoothing`` neighbouring blocks (centred;
    fewer at the ends)."""
    log_loss = torch.log(blocks[:, -1] / blocks[:, 0])
    kernel = torch.ones(1, 1, 2 * smoothing + 1, dtype=torch.float64)
    padded = torch.nn.functional.pad(log_loss.view(1, 1, -1), (smoothing, smoothing))
    counts = torch.nn.functional.pad(torch.ones(1, 1, len(log_loss), dtype=torch.float64), (smoothing, smoothing))
    return (torch.conv1d(padded, kernel) / torch.conv1d(counts, kernel)).view(-1)


def block_depths(blocks: torch.Tensor, smoothing: int = SMOOTHING) -> torch.Tensor:
    """Log-loss depth ``log L_start − log L`` of each block, ``L`` the running minimum of the smoothed loss (first
    passage: a loss spike does not move steps back)."""
    log_loss = smoothed_log_loss(blocks, smoothing)
    return log_loss[0] - torch.cummin(log_loss, 0).values


def summarize_blocks(blocks: torch.Tensor, *, windows: int = 2, trim: float = 0.25, smoothing: int = SMOOTHING,
                     confidence: float = 0.95, loss_positive: bool = True) -> CriticalBatchEstimate:
    """The estimate from consecutive blocks of steps (rows in ``BLOCK_FIELDS`` order): the geometric
    mean over the loss windows; one window over the same range if one of them is unresolved; the run average
    (with the reason in ``method``) when the loss range itself is not usable."""
    blocks = blocks.detach().to("cpu", torch.float64)
    blocks = blocks[blocks[:, 0] > 0]
    if len(blocks) == 0:
        return _run_average(blocks, math.nan, math.nan, confidence, "no step measured")
    if not loss_positive:
        return _run_average(blocks, math.nan, math.nan, confidence, "the loss was not positive, so it has no log scale")
    log_loss = smoothed_log_loss(blocks, smoothing)
    depth = log_loss[0] - torch.cummin(log_loss, 0).values
    loss_start, loss_end = math.exp(float(log_loss[0])), math.exp(float(log_loss.min()))
    if loss_start < MIN_LOSS_FALL * loss_end:
        reason = f"the loss fell by less than {MIN_LOSS_FALL:g}× ({loss_start:.3g} → {loss_end:.3g})"
        return _run_average(blocks, loss_start, loss_end, confidence, reason)
    estimate = _windows_estimate(blocks, _window_masks(depth, windows, trim), confidence, loss_start, loss_end)
    estimate = estimate or _run_average(blocks, loss_start, loss_end, confidence,
                                        "the middle of the loss range is not resolved")
    early, early_low = early_window(blocks, depth, trim, confidence)
    return replace(estimate, early_noise_scale=early, early_noise_scale_low=early_low)


def early_window(blocks: torch.Tensor, depth: torch.Tensor, trim: float,
                 confidence: float = 0.95) -> tuple[float, float]:
    """``Σ tr Σ̂/Σ |Ĝ|²`` over the blocks in the first ``trim`` of the log-loss depth, and the lower end of its
    Fieller interval at ``confidence`` (both ``nan`` if not resolved).

    A constant learning rate has to survive the whole run, and for SGD the phase that limits it is the early
    one, where ``|G|²`` is large and the noise scale small. McCandlish et al.'s ``ε_opt(B) = ε_max/(1 +
    B_noise/B)`` then transfers the LR with *that* phase's ``B_noise``. Measured on digits (SGD; LRs tuned at
    every batch 8…512, ``benchmarks/lr_transfer_digits.py``): the tuned LRs of the MLP fit this form with
    ``B_noise ≈ 11``, and this window read 11–14 from runs at batch 8, 32 and 512, where the run's ``B_crit``
    is 32–35 (``benchmarks/payoff.py``). On breast cancer (held out) it read 34 (lower end 17.6) from a run at
    batch 8, where the tuned LRs fit ``B_noise ≈ 15–30``; an LR increase uses the lower end
    (:mod:`gns_callback.recommendation.learning_rate`)."""
    part = summarize_ratio(blocks[depth <= trim * float(depth[-1]), :_SUMS].sum(0).tolist(), confidence)
    if not (part.effective_steps > 1.0 and 0.0 < part.ratio < math.inf):
        return math.nan, math.nan
    return part.ratio, part.ci_low


def _windows_estimate(blocks: torch.Tensor, masks: list[torch.Tensor], confidence: float, loss_start: float,
                      loss_end: float) -> CriticalBatchEstimate | None:
    steps = int(round(float(blocks[:, 0].sum())))
    parts = [summarize_ratio(blocks[inside, :_SUMS].sum(0).tolist(), confidence) for inside in masks]
    if all(p.effective_steps > 1.0 and p.ci_high < math.inf for p in parts):
        g, low, high = geometric_mean_interval(parts)
        if 0.0 < g < math.inf:
            values = tuple(p.ratio for p in parts)
            return CriticalBatchEstimate(g, low, high, confidence, values, loss_start, loss_end, steps, LOSS_WINDOWS)
    whole = summarize_ratio(blocks[torch.stack(masks).any(0), :_SUMS].sum(0).tolist(), confidence)
    if whole.effective_steps > 1.0 and 0.0 < whole.ratio < math.inf:  # resolved as one window where K are not
        method = f"{LOSS_WINDOWS} (one window: the {len(masks)} windows are not all resolved)"
        return CriticalBatchEstimate(whole.ratio, whole.ci_low, whole.ci_high, confidence, (whole.ratio,),
                                     loss_start, loss_end, steps, method)
    return None


def _window_masks(depth: torch.Tensor, windows: int, trim: float) -> list[torch.Tensor]:
    edges = window_edges(float(depth[-1]), windows, trim)
    last = len(edges) - 1
    return [(depth >= lo) & ((depth <= hi) if k == last else (depth < hi)) for k, (lo, hi) in enumerate(edges)]


def _run_average(blocks: torch.Tensor, loss_start: float, loss_end: float, confidence: float,
                 reason: str) -> CriticalBatchEstimate:
    whole = summarize_ratio(blocks[:, :_SUMS].sum(0).tolist(), confidence)
    steps = int(round(float(blocks[:, 0].sum())))
    return CriticalBatchEstimate(whole.ratio, whole.ci_low, whole.ci_high, confidence, (whole.ratio,), loss_start,
                                 loss_end, steps, f"{RUN_AVERAGE} ({reason})")


# ------------------------------------------------------------------------------------------- online accumulator
def _check_options(windows: int, trim: float, blocks: int, smoothing: int) -> None:
    if not (isinstance(windows, int) and windows >= 1):
        raise ValueError(f"windows must be an integer >= 1 (the number of log-loss windows), got {windows!r}")
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5) (the fraction of the log-loss range left out at each end), "
                         f"got {trim!r}")
    if not (isinstance(blocks, int) and blocks >= 2 and blocks % 2 == 0):
        raise ValueError(f"blocks must be an even integer >= 2 (blocks of steps kept), got {blocks!r}")
    if not (isinstance(smoothing, int) and smoothing >= 0):
        raise ValueError(f"smoothing must be an integer >= 0 (neighbouring blocks on each side), got {smoothing!r}")


class CriticalBatchAccumulator:
    """Per-step ``(tr Σ̂, |Ĝ|², loss)`` summed into consecutive blocks of steps on the device (no host sync per
    update); the loss windows are drawn when :meth:`summary` is read.

    ``update(trace, grad_sq, loss, valid)`` takes 0-d tensors: the step's unbiased estimates (the same pair the
    run-average :class:`~gns_callback.smoothing.RatioAccumulator` gets) and its mean training loss. A step with
    ``valid == False`` (or a non-finite loss) adds nothing. At most ``blocks`` blocks are kept: when they are
    full, neighbouring pairs are merged and the block size doubles, so memory stays fixed.
    """

    def __init__(self, windows: int = 2, trim: float = 0.25, blocks: int = BLOCKS, smoothing: int = SMOOTHING) -> None:
        _check_options(windows, trim, blocks, smoothing)
        self.windows, self.trim, self.smoothing = windows, float(trim), smoothing
        self.blocks = torch.zeros(blocks, len(BLOCK_FIELDS), dtype=torch.float64)
        self.block_size = 1  # steps per block (a power of two)
        self.calls = 0  # updates so far, valid or not: places each step in its block without reading the device
        self.nonpositive_loss = torch.zeros((), dtype=torch.bool)

    def update(self, trace: torch.Tensor, grad_sq: torch.Tensor, loss: torch.Tensor, valid: torch.Tensor) -> None:
        """Add one step (device tensors; no ``.item()``)."""
        step = step_vector(trace, grad_sq)
        loss = loss.detach().to(device=step.device, dtype=torch.float64).reshape(())
        self._to(step.device)
        if self.calls == self.blocks.shape[0] * self.block_size:
            self._merge_pairs()
        valid = valid.to(step.device) & torch.isfinite(loss)
        row = torch.where(valid, torch.cat([step, loss.view(1)]), torch.zeros(len(BLOCK_FIELDS), dtype=torch.float64,
                                                                             device=step.device))
        self.blocks[self.calls // self.block_size] += row  # where() picks: a non-finite step never leaks
        self.nonpositive_loss |= valid & (loss <= 0)
        self.calls += 1

    def update_values(self, step: np.ndarray, loss: float, valid: bool) -> None:
        """:meth:`update` from a host :func:`~gns_callback.smoothing.step_values` and loss (the state moves to the CPU):
        the same sums, with no tensor op but the block's row added in place."""
        self._to(torch.device("cpu"))
        if self.calls == self.blocks.shape[0] * self.block_size:
            self._merge_pairs()
        if valid and math.isfinite(loss):
            self.blocks.numpy()[self.calls // self.block_size] += np.append(step, loss)
            if loss <= 0:
                self.nonpositive_loss = torch.ones((), dtype=torch.bool)
        self.calls += 1

    def _merge_pairs(self) -> None:
        merged = self.blocks.view(-1, 2, len(BLOCK_FIELDS)).sum(1)
        self.blocks = torch.cat([merged, torch.zeros_like(merged)])
        self.block_size *= 2

    def _to(self, device: torch.device) -> None:
        if self.blocks.device != device:
            self.blocks = self.blocks.to(device)
            self.nonpositive_loss = self.nonpositive_loss.to(device)

    def summary(self, confidence: float = 0.95) -> CriticalBatchEstimate:
        """Read the estimate (one device-to-host copy of the blocks)."""
        return summarize_blocks(self.blocks, windows=self.windows, trim=self.trim, smoothing=self.smoothing,
                                confidence=confidence, loss_positive=not bool(self.nonpositive_loss))

    def state_dict(self) -> dict:
        return {"windows": self.windows, "trim": self.trim, "smoothing": self.smoothing, "calls": self.calls,
                "block_size": self.block_size, "blocks": self.blocks.tolist(),
                "nonpositive_loss": bool(self.nonpositive_loss)}

    def load_state_dict(self, state: dict) -> None:
        device = self.blocks.device
        self.windows, self.trim, self.smoothing = int(state["windows"]), float(state["trim"]), int(state["smoothing"])
        self.calls, self.block_size = int(state["calls"]), int(state["block_size"])
        self.blocks = torch.tensor([[*full_sums(row[:-1]), row[-1]] for row in state["blocks"]], dtype=torch.float64,
                                   device=device)
        self.nonpositive_loss = torch.tensor(bool(state["nonpositive_loss"]), device=device)


Values = Sequence[float] | torch.Tensor | np.ndarray


def step_blocks(trace: Values, grad_sq: Values, loss: Values, blocks: int = BLOCKS) -> tuple[torch.Tensor, bool]:
    """The accumulator's blocks (``BLOCK_FIELDS`` rows) for per-step arrays, and whether every loss was positive.
    Steps with a non-finite entry are skipped (they keep their place, as in the accumulator)."""
    x, y, l = (np.asarray(torch.as_tensor(v, dtype=torch.float64).cpu(), dtype=np.float64).reshape(-1)
               for v in (trace, grad_sq, loss))
    if not len(x) == len(y) == len(l):
        raise ValueError(f"trace, grad_sq and loss must have the same length, got {len(x)}, {len(y)}, {len(l)}")
    block_size = 1
    while len(x) > blocks * block_size:
        block_size *= 2
    valid = np.isfinite(x) & np.isfinite(y) & np.isfinite(l)
    rows = np.stack([*moment_columns(x, y, np.ones_like(x)), l], axis=1)
    sums = np.zeros((blocks, len(BLOCK_FIELDS)))
    np.add.at(sums, np.arange(len(x))[valid] // block_size, rows[valid])
    return torch.from_numpy(sums), bool((l[valid] > 0).all())


def critical_batch_size(trace: Values, grad_sq: Values, loss: Values, *, confidence: float = 0.95, windows: int = 2,
                        trim: float = 0.25, blocks: int = BLOCKS, smoothing: int = SMOOTHING) -> CriticalBatchEstimate:
    """The estimate from per-step arrays of equal length: unbiased ``tr Σ̂_t`` and ``|Ĝ_t|²`` estimates and the
    step's mean training loss. Steps with a non-finite entry are skipped. The same blocks, hence the same result,
    as feeding the steps to :class:`CriticalBatchAccumulator` one by one (vectorised here)."""
    _check_options(windows, trim, blocks, smoothing)
    sums, loss_positive = step_blocks(trace, grad_sq, loss, blocks)
    return summarize_blocks(sums, windows=windows, trim=trim, smoothing=smoothing, confidence=confidence,
                            loss_positive=loss_positive)


def critical_batch_target(estimate: CriticalBatchEstimate) -> dict[str, Any]:
    """``estimate`` in the shape :func:`gns_callback.recommendation.recommend` reads a noise scale: the batch to
    aim at (``b_simple``) with its statistical interval; ``averaging`` names where it came from;
    ``lr_noise_scale`` the early phase's noise scale, for the SGD learning-rate transfer, and
    ``lr_noise_scale_low`` the lower end of its interval."""
    return {"b_simple": estimate.b_crit, "ci_low": estimate.ci_low, "ci_high": estimate.ci_high,
            "steps": estimate.steps, "confidence": estimate.confidence,
            "averaging": f"critical batch ({estimate.method})", "lr_noise_scale": estimate.early_noise_scale,
            "lr_noise_scale_low": estimate.early_noise_scale_low}
