"""A recent noise-scale estimate that follows a moving run: a local-linear ratio fit on normalised steps.

Separate exponential moving averages of ``x = tr Σ̂`` and ``y = |Ĝ|²`` lag badly while training moves: ``|G|²``
often falls by 10–100× within a few hundred steps, so the old, large ``y`` dominate the smoothed denominator and
``Σw·x/Σw·y`` reads far below the current ``B_simple = X/Y`` (0.1–0.7× on real runs, even without noise).
:class:`LocalLinearRatio` fixes both causes of that lag:

1. **Ratio-scale weights.** Each step's pair is divided by a predictable scale ``s_t`` (a short EMA of earlier
   steps' ``scale`` input, by default ``|x| + |y|``): ``x̃ = x/s``, ``ỹ = y/s``. The ratio of one step is
   unchanged, but no step weighs more because ``|G|²`` was large then, and the steps' noise (which grows with
   ``tr Σ`` and ``|G|²``) becomes roughly constant: the weights are the inverse-noise weights of a ratio
   estimator with a locally constant ratio.
2. **A local linear trend** in the ratio, fitted with exponential weights ``w_s = d^(T−s)``. With
   ``u_s = s − T ≤ 0``, the model ``E x̃_s = (R + c·u_s)·E ỹ_s`` has the estimating equations
   ``Σw·x̃ = R·Σw·ỹ + c·Σw·u·ỹ`` and ``Σw·u·x̃ = R·Σw·u·ỹ + c·Σw·u²·ỹ``, so

       R̂ = (X0·Y2 − X1·Y1) / (Y0·Y2 − Y1²),   Xk = Σ w·u^k·x̃,  Yk = Σ w·u^k·ỹ,

   which is ``Σv·x̃/Σv·ỹ`` with the kernel ``v_s = w_s·(Y2 − u_s·Y1)``. A constant-level EMA lags a ratio that
   drifts at rate ``g`` by about ``g·d/(1−d)``; the linear term removes that first-order lag (the ratio-scale
   analogue of Brown's double exponential smoothing, Brown 1963). All sums follow linear recursions
   (``u → u − 1`` when a step arrives), so an update is one small matrix product on the device.

**Interval.** Fieller's set (Fieller 1954) for ``Σv·x̃/Σv·ỹ`` with ``v`` held fixed:
``(mx − R·my)² ≤ t²·Σv²·(vxx − 2R·vxy + R²·vyy)``, where ``vxx, vyy, vxy`` are the per-step (co)variances of
``x̃`` and ``ỹ`` about their own weighted linear trends (``E[Σw·r²] = σ²·(Σw − tr(M⁻¹Q))`` for weighted least
squares, ``M = Σw·z·zᵀ``, ``Q = Σw²·z·zᵀ``, ``z = (1, u)``) and ``t`` the Student-t quantile with
``n_eff − 2`` degrees of freedom, ``n_eff = (Σw)²/Σw²``.

**Windows.** The sums are kept at ``n_eff`` ≈ ``(1+d)/(1−d)`` and at 4× and 16× that. :meth:`summary` reports
the trend fit at the base window while its ratio is finite and positive (its ``|G|²`` and ``tr Σ`` came out
positive). When it is not, the data cannot support a trend, and the reading falls back to the level alone (the
ratio-scale EMA) at the base window, then at the longer ones, with that fit's interval (unbounded above while
``|G|²`` is not resolved).

Measured along SGD runs against the exact ``B_simple`` at every step: ``benchmarks/trajectory_tracking.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from gns_callback.confidence import fieller_interval, t_quantile
from gns_callback.smoothing import RatioSummary

#: Order of the entries of one window's row in :attr:`LocalLinearRatio.sums` (``w = d^(T−s)``, ``u = s − T``).
TREND_FIELDS = ("w", "wu", "wuu", "w2", "w2u", "w2uu", "x", "ux", "y", "uy", "uuy", "xx", "yy", "xy")
#: Window lengths, as multiples of the base window, kept side by side.
WINDOW_FACTORS = (1, 4, 16)
_TRIPLES = ((0, 1, 2, False), (3, 4, 5, True), (8, 9, 10, False))  # (Σf, Σuf, Σu²f, squared weights)
_PAIRS = ((6, 7),)  # (Σf, Σuf)
_PLAIN = (11, 12, 13)


@dataclass(frozen=True)
class TrendFit:
    """One window's ratio with or without the linear trend, before choosing among windows."""

    summary: RatioSummary

    @property
    def usable(self) -> bool:
        """A finite, positive ratio: ``|G|²`` and ``tr Σ`` both came out positive in this window."""
        return math.isfinite(self.summary.ratio) and self.summary.ratio > 0.0


def decay_for_window(effective_steps: float) -> float:
    """The EMA decay whose asymptotic effective sample size ``(1+d)/(1−d)`` is ``effective_steps``."""
    return (effective_steps - 1.0) / (effective_steps + 1.0)


def window_for_decay(decay: float) -> float:
    """``n_eff = (1+d)/(1−d)`` of an EMA with decay ``d`` (``inf`` for ``d = 1``)."""
    return math.inf if decay >= 1.0 else (1.0 + decay) / (1.0 - decay)


def transition_matrix(decay: float) -> torch.Tensor:
    """Linear map of one window's sums when time advances one step (before the new step is added).

    Each ``(Σf, Σu·f, Σu²·f)`` triple with weights ``w`` becomes ``d·(Σf, Σu·f − Σf, Σu²·f − 2Σu·f + Σf)``
    (every ``u`` falls by one); sums over ``w²`` use ``d²``.
    """
    m = torch.zeros(len(TREND_FIELDS), len(TREND_FIELDS), dtype=torch.float64)
    for first, second, third, squared in _TRIPLES:
        d = decay * decay if squared else decay
        m[first, first] = d
        m[second, second], m[second, first] = d, -d
        m[third, third], m[third, second], m[third, first] = d, -2.0 * d, d
    for first, second in _PAIRS:
        m[first, first] = decay
        m[second, second], m[second, first] = decay, -decay
    for i in _PLAIN:
        m[i, i] = decay
    return m


def step_row_map() -> tuple[torch.Tensor, torch.Tensor]:
    """``(base, map)`` with ``base + map @ (x̃, ỹ, x̃², ỹ², x̃ỹ)`` = what one new step (at ``u = 0``, weight 1)
    adds to a window's sums, in ``TREND_FIELDS`` order."""
    base = torch.zeros(len(TREND_FIELDS), dtype=torch.float64)
    base[[0, 3]] = 1.0  # Σw and Σw² gain weight 1
    mapping = torch.zeros(len(TREND_FIELDS), 5, dtype=torch.float64)
    for feature, field in enumerate((6, 8, 11, 12, 13)):
        mapping[field, feature] = 1.0
    return base, mapping


def detrended_moments(sums: Sequence[float]) -> Optional[tuple[float, float, float, float]]:
    """Per-step ``(vxx, vyy, vxy, dof)`` of ``x̃``, ``ỹ`` about their weighted linear trends in ``u``.

    Weighted least squares on ``z = (1, u)``: residual sum ``Σw·f² − bᵀM⁻¹b`` (``b = (Σw·f, Σw·u·f)``,
    ``M = Σw·z·zᵀ``) over ``Σw − tr(M⁻¹Q)`` (``Q = Σw²·z·zᵀ``): unbiased for independent steps of equal variance.
    ``dof = n_eff − 2``. None while the trend is not identified (fewer than three steps).
    """
    w, wu, wuu, w2, w2u, w2uu, sx, sux, sy, suy, _, sxx, syy, sxy = sums
    det = w * wuu - wu * wu
    if w <= 0.0 or det <= 1e-12 * max(w * wuu, 1e-300):
        return None
    inv = ((wuu / det, -wu / det), (-wu / det, w / det))

    def quad(a0: float, a1: float, b0: float, b1: float) -> float:
        return a0 * (inv[0][0] * b0 + inv[0][1] * b1) + a1 * (inv[1][0] * b0 + inv[1][1] * b1)

    denominator = w - (inv[0][0] * w2 + 2.0 * inv[0][1] * w2u + inv[1][1] * w2uu)
    dof = w * w / w2 - 2.0
    if denominator <= 0.0 or dof <= 0.0:
        return None
    vxx = max(sxx - quad(sx, sux, sx, sux), 0.0) / denominator
    vyy = max(syy - quad(sy, suy, sy, suy), 0.0) / denominator
    vxy = (sxy - quad(sx, sux, sy, suy)) / denominator
    return vxx, vyy, vxy, dof


def fit_window(sums: Sequence[float], scale: float, confidence: float, trend: bool) -> TrendFit:
    """One window's ratio and Fieller interval, with (``trend=True``) or without the linear trend.

    With the trend: ``mx = X0·Y2 − X1·Y1``, ``my = Y0·Y2 − Y1²`` (``Σv·x̃``, ``Σv·ỹ`` for ``v = w·(Y2 − u·Y1)``),
    variance factor ``Σv² = Y2²·Σw² − 2·Y2·Y1·Σw²u + Y1²·Σw²u²``. Without: ``mx = X0``, ``my = Y0``, ``Σv² = Σw²``.
    ``mean_x``/``mean_y`` are the kernel-weighted means of ``x̃``, ``ỹ`` times the current ``scale``.
    """
    w, wu, _, w2, w2u, w2uu, sx, sux, sy, suy, suuy = sums[:11]
    if w <= 0.0:
        return TrendFit(RatioSummary(math.nan, math.nan, math.nan, 0.0, math.inf, 0.0))
    if trend:
        mx, my = sx * suuy - sux * suy, sy * suuy - suy * suy
        total = w * suuy - wu * suy
        square = suuy * suuy * w2 - 2.0 * suuy * suy * w2u + suy * suy * w2uu
    else:
        mx, my, total, square = sx, sy, w, w2
    ratio = max(mx / my, 0.0) if my > 0.0 else math.inf
    n_eff = total * total / square if square > 0.0 else 0.0
    means = (mx / total * scale, my / total * scale) if total != 0.0 else (math.nan, math.nan)
    moments = detrended_moments(sums)
    if moments is None or my <= 0.0:
        return TrendFit(RatioSummary(*means, ratio, 0.0, math.inf, n_eff))
    vxx, vyy, vxy, dof = moments
    t = t_quantile(confidence, dof)
    low, high = fieller_interval(mx, my, square * vxx, square * vyy, square * vxy, t)
    return TrendFit(RatioSummary(*means, ratio, low, high, n_eff))


def choose_fit(fits: Sequence[TrendFit]) -> RatioSummary:
    """The first fit with a finite, positive ratio (candidates ordered from least to most lag), else the first.

    Choosing by the *realised* interval instead (the first bounded one) biased the reading low in simulations and
    on real runs: a window's interval is bounded when its ``|G|²`` happens to come out high.
    """
    for fit in fits:
        if fit.usable:
            return fit.summary
    return fits[0].summary


class LocalLinearRatio:
    """Recent ``B_simple`` that tracks a moving run: local-linear ratio fit on normalised steps (module docstring).

    A drop-in for :class:`gns_callback.smoothing.RatioAccumulator` as the meter's recent estimate: the sums stay on
    the device, :meth:`update` never syncs with the host, :meth:`summary` copies once.

    Args:
        decay: weight of the past in the base window, in ``(0, 1)`` (``0.99``: ``n_eff`` ≈ 199 steps). Level-only
            fits there and at windows of 4× and 16× that are the fallbacks while the trend fit cannot resolve
            ``|G|²``.
        scale_decay: decay of the short EMA of earlier steps' ``scale`` that normalises each step, in ``[0, 1)``.
        batch_shape: independent streams kept side by side (simulations); ``()`` for one.
    """

    def __init__(self, decay: float = 0.99, scale_decay: float = 0.8, batch_shape: Sequence[int] = ()) -> None:
        _check_decay("decay", decay, "e.g. 0.99 (about the last 200 steps)", upper_open=True, lower_open=True)
        _check_decay("scale_decay", scale_decay, "e.g. 0.8 (about the last 9 steps)", upper_open=True)
        self.decay = float(decay)
        self.scale_decay = float(scale_decay)
        self.batch_shape = tuple(int(b) for b in batch_shape)
        n = window_for_decay(self.decay)
        self.decays = [decay_for_window(n * factor) for factor in WINDOW_FACTORS]
        self._transitions = torch.stack([transition_matrix(d) for d in self.decays])
        self._row_base, self._row_map = step_row_map()
        self.sums = torch.zeros(*self.batch_shape, len(self.decays), len(TREND_FIELDS), dtype=torch.float64)
        self.scale_state = torch.zeros(*self.batch_shape, 2, dtype=torch.float64)  # (Σ d_s^k·scale, Σ d_s^k)

    # ------------------------------------------------------------------ per step, on the device
    def update(self, x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor,
               scale: Optional[torch.Tensor] = None) -> None:
        """Add one step's ``x = tr Σ̂``, ``y = |Ĝ|²`` (shape ``batch_shape``); where ``valid`` is False, or an input
        is not finite, nothing changes.

        ``scale``: positive, proportional to the step's noise, e.g. the big-batch ``|G_B|²`` (``= y + x/B``);
        default ``|x| + |y|``.
        """
        x, y = x.to(torch.float64), y.to(torch.float64)
        scale = (x.abs() + y.abs()) if scale is None else torch.as_tensor(scale, dtype=torch.float64,
                                                                              device=x.device)
        self._to(x.device)
        valid = torch.as_tensor(valid, device=x.device) & torch.isfinite(x + y + scale) & (scale > 0)
        total, count = self.scale_state[..., 0], self.scale_state[..., 1]
        previous = torch.where(count > 0, total / count.clamp_min(1e-300), scale)  # predictable: earlier steps
        xn, yn = x / previous, y / previous
        features = torch.stack([xn, yn, xn * xn, yn * yn, xn * yn], -1)
        row = self._row_base + features @ self._row_map.T
        advanced = self._advance(self.sums) + row.unsqueeze(-2)
        self.sums = torch.where(valid[..., None, None], advanced, self.sums)
        new_scale = self.scale_state * self.scale_decay + torch.stack([scale, torch.ones_like(scale)], -1)
        self.scale_state = torch.where(valid[..., None], new_scale, self.scale_state)

    def _advance(self, sums: torch.Tensor) -> torch.Tensor:
        """Every window's sums one step later (before the new step is added): ``M_k @ sums_k``."""
        if self.batch_shape:
            return torch.einsum("kij,...kj->...ki", self._transitions, sums)  # no per-stream copy of M
        return (self._transitions @ sums.unsqueeze(-1)).squeeze(-1)

    def update_vector(self, step: torch.Tensor, valid: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        """:meth:`update` from a :func:`gns_callback.smoothing.step_vector` (``x``, ``y`` at entries 2 and 3)."""
        self.update(step[2], step[3], valid, scale)

    # ------------------------------------------------------------------ reading, on the host
    def summary(self, confidence: float = 0.95) -> RatioSummary:
        """The recent ratio and its interval (one device-to-host copy); see the module docstring."""
        if self.batch_shape:
            raise ValueError(f"summary() reads one stream; this tracker holds batch_shape={self.batch_shape}: "
                             "use summaries().")
        return self.summaries(confidence)[0]

    def summaries(self, confidence: float = 0.95) -> list[RatioSummary]:
        """:meth:`summary` of every stream, in row-major order of ``batch_shape`` (one device-to-host copy)."""
        return [choose_fit(fits) for fits in self.fits(confidence)]

    def fits(self, confidence: float = 0.95) -> list[list[TrendFit]]:
        """Per stream, the candidates in the order :func:`choose_fit` tries them: the trend fit at the base
        window, then the level-only fits at each window (base, 4×, 16×)."""
        windows = len(self.decays)
        rows = self.sums.reshape(-1, windows, len(TREND_FIELDS)).tolist()
        scales = self.scale_state.reshape(-1, 2).tolist()
        out = []
        for stream, (total, count) in zip(rows, scales):
            scale = total / count if count > 0 else math.nan
            trend = fit_window(stream[0], scale, confidence, trend=True)
            out.append([trend] + [fit_window(row, scale, confidence, trend=False) for row in stream])
        return out

    def state_dict(self) -> dict:
        """Plain types only (checkpoints load with ``weights_only=True``)."""
        return {"decay": self.decay, "scale_decay": self.scale_decay, "batch_shape": list(self.batch_shape),
                "sums": self.sums.tolist(), "scale_state": self.scale_state.tolist()}

    def load_state_dict(self, state: dict) -> None:
        device = self.sums.device
        fresh = LocalLinearRatio(float(state["decay"]), float(state["scale_decay"]), state.get("batch_shape", ()))
        fresh.sums = torch.tensor(state["sums"], dtype=torch.float64)
        fresh.scale_state = torch.tensor(state["scale_state"], dtype=torch.float64)
        fresh._to(device)
        self.__dict__.update(fresh.__dict__)

    def _to(self, device: torch.device) -> None:
        if self.sums.device != device:
            self.sums = self.sums.to(device)
            self.scale_state = self.scale_state.to(device)
            self._transitions = self._transitions.to(device)
            self._row_base, self._row_map = self._row_base.to(device), self._row_map.to(device)


def _check_decay(name: str, value: float, hint: str, upper_open: bool, lower_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0.0 if lower_open else value >= 0.0) and (value < 1.0 if upper_open else value <= 1.0)
    if not ok:
        low = "(0" if lower_open else "[0"
        raise ValueError(f"{name}={value!r}: a number in {low}, 1), {hint}.")


__all__ = ["LocalLinearRatio", "TrendFit", "TREND_FIELDS", "WINDOW_FACTORS", "fit_window", "choose_fit",
           "detrended_moments", "transition_matrix", "decay_for_window", "window_for_decay"]
