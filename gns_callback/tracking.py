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
   (``u → u − 1`` when a step arrives) with a closed form over many steps, so steps are buffered on the device
   and folded in by blocks.

**Interval.** Fieller's set (Fieller 1954) for ``Σv·x̃/Σv·ỹ`` with ``v`` held fixed:
``(mx − R·my)² ≤ t²·Σv²·(vxx − 2R·vxy + R²·vyy)``, where ``vxx, vyy, vxy`` are the per-step (co)variances of
``x̃`` and ``ỹ`` about their own weighted linear trends (``E[Σw·r²] = σ²·(Σw − tr(M⁻¹Q))`` for weighted least
squares, ``M = Σw·z·zᵀ``, ``Q = Σw²·z·zᵀ``, ``z = (1, u)``) and ``t`` the Student-t quantile with
``n_eff − 2`` degrees of freedom, ``n_eff = (Σw)²/Σw²``. It covers the *local* value, the ratio of the recent
means of ``tr Σ`` and ``|G|²``. Under SGD the exact per-step value also jitters around it, because the
parameters do (a median 14% from one step to the next on the digits MLP of the benchmark, more than 1.8× on one
step in ten late in the run). Where the measurement is precise enough for the interval to be narrower than that
jitter, the interval covers the instantaneous value less often than its nominal rate (benchmarks/RESULTS.md).

**Windows, chosen by the measured drift.** The sums are kept at ``n_eff`` ≈ ``(1+d)/(1−d)`` and at 4× and 16×
that. Each window gives a trend fit and a level-only fit (the ratio-scale EMA), six candidates ordered from least
to most smoothing: trend then level at 1×, at 4×, at 16×. While nothing moves the longer ones are far more
accurate (at fixed parameters after 300 steps, ``n_eff`` of the base trend fit ≈ 58, of the 16× level ≈ 300);
while the run moves they lag. :func:`choose_fit` reads the most smoothed candidate the data cannot tell from the
less smoothed ones, Lepski's rule (Lepski 1991; Lepski, Mammen & Spokoiny 1997): the last candidate such that
every candidate before it has steps consistent with its ratio (:func:`consistent`: Fieller's statistic
``mx_s − R·my_s``, whose variance accounts for the two kernels sharing their steps). The longest candidate faces
five such checks, so each is at Bonferroni's level, ``1 − (1 − c)/5`` for the interval's confidence ``c``: at fixed
parameters the reading is the longest window with probability at least ``c``. (With each check at ``c`` and the
walk stopping at the first rejection, about one stream in six stopped at a short window at fixed parameters, and
the recent value's mean error was 0.096 against the longest window's 0.068 on 200 streams of the cases of
``benchmarks/accuracy_peers.py``; now 0.082. Along the runs of ``benchmarks/trajectory_tracking.py`` the readings
did not move: geometric means 0.95 → 0.98 on the digits MLP, 0.99 → 0.98 on the logistic regression. A steep
synthetic drift, ``B_simple`` rising 15× in 400 steps, lags more: 0.85× at the last step instead of 0.90×.) The
weights of every window are ``d^a`` over the valid steps only, so the cross-window sums of that variance follow in
closed form from the number of steps (:func:`power_sums`), read back from ``Σw``: nothing more is kept per step.

A drift too slow to be detected can still bias a longer window by about its own standard error (no interval can
adapt to an unknown drift and keep its coverage, Low 1997), so the choice moves the point estimate only: the
interval reported is the base trend fit's, as before the window was chosen (widened to hold the chosen ratio in
the rare case it lies outside), and covers as often; trust decisions read from it are unchanged. The choice is made
only from a base trend fit that resolves ``|G|²`` (a bounded interval). Without that it has no power: where
``B_simple`` is many times the batch, even a lag of the longer windows by 2–5× is consistent with the base window's
noise, and a choice from an unresolved base read 0.5× on the logistic regression of the trajectory benchmark (the
meter's default stream, 16 of 32 examples). There, and with too few steps for the test, the reading is the base
trend fit while its ratio is finite and positive, else the base level fit, else the first longer level fit that
every shorter candidate is consistent with, read with the base trend fit's interval, else the base trend fit
(``inf``; :func:`fallback_fit`). A longer window's own interval covers that window's mean, which lags a moving run:
read with it, the 4× window gave 110 [80, 170] against an exact 1,200–2,200 on a breast-cancer MLP under AdamW.
Starting the walk instead from the shortest window whose trend fit resolves ``|G|²`` (the 4× window's, where the
base's does not) was measured and not taken: at fixed parameters it halved the recent value's error on the digits
CNN of ``benchmarks/accuracy_peers.py`` (mean |rel err| 0.220 → 0.110 over 200 streams of 400 steps, 21 unresolved
at the base window), but on a steep rise (``B_simple`` 40 → 600 in 400 steps, B = 32) the rebased streams read the
4× and 16× trend fits, which lag there (0.85× and 0.78×), and the reading's geometric mean fell from 1.0× to 0.71×.

Measured along SGD runs against the exact ``B_simple`` at every step: ``benchmarks/trajectory_tracking.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch

from gns_callback.confidence import fieller_interval, t_quantile
from gns_callback.smoothing import RatioSummary

#: Order of the entries of one window's row in :attr:`LocalLinearRatio.sums` (``w = d^(T−s)``, ``u = s − T``).
TREND_FIELDS = ("w", "wu", "wuu", "w2", "w2u", "w2uu", "x", "ux", "y", "uy", "uuy", "xx", "yy", "xy")
#: Window lengths, as multiples of the base window, kept side by side.
WINDOW_FACTORS = (1, 4, 16)
_CPU = torch.device("cpu")
#: Steps buffered on the device before they are folded into the sums in one vectorised block.
BLOCK = 128


@dataclass(frozen=True)
class Kernel:
    """A fit's step weights ``v_s = w_s·(alpha + beta·u_s)`` at window ``window`` (``w = d^(T−s)``, ``u = s − T``):
    ``(Y2, −Y1)`` for the trend fit, ``(1, 0)`` for the level."""

    window: int
    alpha: float
    beta: float


@dataclass(frozen=True)
class TrendFit:
    """One window's ratio with (``trend``) or without the linear trend, before choosing among windows: its summary,
    the kernel sums ``mx = Σv·x̃``, ``my = Σv·ỹ`` and the kernel ``v``."""

    summary: RatioSummary
    mx: float = math.nan
    my: float = math.nan
    kernel: Kernel = Kernel(0, 1.0, 0.0)
    trend: bool = False

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


def advance_sums(sums: torch.Tensor, decays: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Every window's sums ``steps`` steps later with nothing added (``steps``: batch-shaped tensor).

    Each ``(Σf, Σu·f, Σu²·f)`` triple with weights ``w`` becomes ``d^P·(Σf, Σu·f − P·Σf, Σu²·f − 2P·Σu·f + P²·Σf)``
    (every ``u`` falls by ``P``); sums over ``w²`` use ``d^(2P)``.
    """
    p = steps.to(sums.dtype).unsqueeze(-1)
    d = decays ** p
    dd = d * d
    s = sums.unbind(-1)

    def triple(a: int, b: int, c: int, f: torch.Tensor) -> list[torch.Tensor]:
        return [f * s[a], f * (s[b] - p * s[a]), f * (s[c] - 2.0 * p * s[b] + p * p * s[a])]

    return torch.stack(triple(0, 1, 2, d) + triple(3, 4, 5, dd) + [d * s[6], d * (s[7] - p * s[6])]
                       + triple(8, 9, 10, d) + [d * s[11], d * s[12], d * s[13]], -1)


def block_sums(x_norm: torch.Tensor, y_norm: torch.Tensor, mask: torch.Tensor, decays: torch.Tensor) -> torch.Tensor:
    """Sums (``TREND_FIELDS``, per window) of a block of steps ``[..., n]`` on their own, ``u = 0`` at the block's
    last valid step; ``mask`` (0/1) marks the valid steps, the others count for nothing and take no time."""
    age = mask.sum(-1, keepdim=True) - torch.cumsum(mask, -1)  # valid steps after each one
    w = torch.where(mask.unsqueeze(-2) > 0, decays.unsqueeze(-1) ** age.unsqueeze(-2), 0.0)  # [..., K, n]
    w2, u = w * w, -age.unsqueeze(-2)
    x, y = x_norm.unsqueeze(-2), y_norm.unsqueeze(-2)
    wx, wy = w * x, w * y
    fields = [w, w * u, w * u * u, w2, w2 * u, w2 * u * u, wx, wx * u, wy, wy * u, wy * u * u, wx * x, wy * y, wx * y]
    return torch.stack([f.sum(-1) for f in fields], -1)


def predictable_scales(scale: torch.Tensor, mask: torch.Tensor, state: torch.Tensor,
                       decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block step's normaliser, the EMA of the *earlier* valid steps' ``scale`` (its own at the very first
    step), and the EMA state ``(Σ d^k·scale, Σ d^k)`` after the block. ``scale`` of invalid steps must be finite."""
    n = scale.shape[-1]
    before = torch.cumsum(mask, -1) - mask  # valid steps before each step
    position = torch.cat([before, mask.sum(-1, keepdim=True)], -1)  # ... and after the last: [..., n + 1]
    earlier = torch.arange(n + 1, device=scale.device).unsqueeze(-1) > torch.arange(n, device=scale.device)
    exponent = (position.unsqueeze(-1) - before.unsqueeze(-2) - 1.0).clamp_min(0.0)  # [..., n + 1, n]
    weights = torch.where(earlier & (mask.unsqueeze(-2) > 0), decay ** exponent, 0.0)
    carried = decay ** position
    total = carried * state[..., :1] + (weights @ scale.unsqueeze(-1)).squeeze(-1)
    count = carried * state[..., 1:] + weights.sum(-1)
    previous = torch.where(count[..., :n] > 0, total[..., :n] / count[..., :n].clamp_min(1e-300), scale)
    return previous, torch.stack([total[..., n], count[..., n]], -1)


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


def level_moments(sums: Sequence[float]) -> Optional[tuple[float, float, float, float]]:
    """Per-step ``(vxx, vyy, vxy, dof)`` of ``x̃``, ``ỹ`` about their weighted means (reliability weights, as
    :func:`gns_callback.smoothing.summarize_ratio`), ``dof = n_eff − 1``; None before two steps."""
    w, _, _, w2, _, _, sx, _, sy, _, _, sxx, syy, sxy = sums
    dof = w * w / w2 - 1.0 if w2 > 0.0 else 0.0
    if w <= 0.0 or dof <= 1e-9:
        return None
    norm, mx, my = w - w2 / w, sx / w, sy / w
    return (max(sxx - w * mx * mx, 0.0) / norm, max(syy - w * my * my, 0.0) / norm, (sxy - w * mx * my) / norm,
            dof)


def fit_window(sums: Sequence[float], scale: float, confidence: float, trend: bool, window: int = 0) -> TrendFit:
    """One window's ratio and Fieller interval, with (``trend=True``) or without the linear trend.

    With the trend: ``mx = X0·Y2 − X1·Y1``, ``my = Y0·Y2 − Y1²`` (``Σv·x̃``, ``Σv·ỹ`` for ``v = w·(Y2 − u·Y1)``),
    variance factor ``Σv² = Y2²·Σw² − 2·Y2·Y1·Σw²u + Y1²·Σw²u²``, per-step (co)variances about the linear trends.
    Without: ``mx = X0``, ``my = Y0``, ``Σv² = Σw²``, (co)variances about the means (the ratio-scale EMA, read as
    :func:`gns_callback.smoothing.summarize_ratio` reads the EMA of the parts).
    ``mean_x``/``mean_y`` are the kernel-weighted means of ``x̃``, ``ỹ`` times the current ``scale``. The kernel's
    sign is taken so that ``Σv > 0``: ``Σv·x̃/Σv·ỹ`` and Fieller's set are the same for ``−v``, but ``|G|²`` is
    resolved only where ``my`` has the sign of ``Σv`` (with it negative, a ``|G|²`` read below zero read as
    ``B_simple = 0``, not ``inf``, at a least-squares minimum).
    """
    w, wu, _, w2, w2u, w2uu, sx, sux, sy, suy, suuy = sums[:11]
    if w <= 0.0:
        return TrendFit(RatioSummary(math.nan, math.nan, math.nan, 0.0, math.inf, 0.0), trend=trend)
    if trend:
        mx, my = sx * suuy - sux * suy, sy * suuy - suy * suy
        total = w * suuy - wu * suy
        square = suuy * suuy * w2 - 2.0 * suuy * suy * w2u + suy * suy * w2uu
        kernel = Kernel(window, suuy, -suy)
    else:
        mx, my, total, square = sx, sy, w, w2
        kernel = Kernel(window, 1.0, 0.0)
    if total < 0.0:  # a trend kernel whose weights sum below zero (ỹ near zero, of either sign): the same fit, v → −v
        mx, my, total, kernel = -mx, -my, -total, Kernel(window, -kernel.alpha, -kernel.beta)
    ratio = max(mx / my, 0.0) if my > 0.0 else math.inf
    n_eff = total * total / square if square > 0.0 else 0.0
    means = (mx / total * scale, my / total * scale) if total != 0.0 else (math.nan, math.nan)
    moments = detrended_moments(sums) if trend else level_moments(sums)
    if moments is None or my <= 0.0:
        return TrendFit(RatioSummary(*means, ratio, 0.0, math.inf, n_eff), mx, my, kernel, trend)
    vxx, vyy, vxy, dof = moments
    t = t_quantile(confidence, dof)
    low, high = fieller_interval(mx, my, square * vxx, square * vyy, square * vxy, t)
    return TrendFit(RatioSummary(*means, ratio, low, high, n_eff), mx, my, kernel, trend)


def power_sums(q: float, steps: float) -> tuple[float, float, float]:
    """``Σ_{a<n} q^a·a^m`` for ``m = 0, 1, 2`` (``n = steps``, may be ``inf``), in closed form.

    The infinite sums ``I0 = 1/(1−q)``, ``I1 = q/(1−q)²``, ``I2 = q(1+q)/(1−q)³`` less their tails from ``a = n``:
    ``q^n·Σ_b q^b·(b + n)^m``.
    """
    if q <= 0.0:
        return (1.0, 0.0, 0.0) if steps >= 1 else (0.0, 0.0, 0.0)
    i0, i1, i2 = 1.0 / (1.0 - q), q / (1.0 - q) ** 2, q * (1.0 + q) / (1.0 - q) ** 3
    tail = q ** steps if math.isfinite(steps) else 0.0
    if tail == 0.0:
        return i0, i1, i2
    n = steps
    return i0 - tail * i0, i1 - tail * (i1 + n * i0), i2 - tail * (i2 + 2.0 * n * i1 + n * n * i0)


def steps_of(sums: Sequence[float], decay: float) -> float:
    """Valid steps ``n`` folded into one window's sums, from ``Σw = (1 − d^n)/(1 − d)`` (``inf`` once ``d^n``
    underflows: the weights no longer depend on ``n`` then)."""
    if decay <= 0.0:
        return 1.0 if sums[0] > 0.0 else 0.0
    fraction = sums[0] * (1.0 - decay)
    return math.log1p(-fraction) / math.log(decay) if fraction < 1.0 - 1e-15 else math.inf


def cross_product(a: Kernel, b: Kernel, decays: Sequence[float], steps: float) -> float:
    """``Σ_s v_a,s·v_b,s`` of two kernels ``v = w·(α + β·u)`` (``u = −a`` steps ago, ``w = d^a``) over ``steps``."""
    s0, s1, s2 = power_sums(decays[a.window] * decays[b.window], steps)
    return a.alpha * b.alpha * s0 - (a.alpha * b.beta + a.beta * b.alpha) * s1 + a.beta * b.beta * s2


@dataclass(frozen=True)
class WindowTest:
    """What :func:`consistent` needs besides the two fits: the windows' ``decays``, the valid ``steps`` folded in,
    the per-step ``noise = (vxx, vyy, vxy)`` of ``x̃``, ``ỹ`` about the base window's trends, and the threshold ``t``
    (Student-t at the interval's confidence, the base window's degrees of freedom)."""

    decays: tuple[float, ...]
    steps: float
    noise: tuple[float, float, float]
    t: float


def consistent(short: TrendFit, long: TrendFit, test: WindowTest) -> bool:
    """Whether the ``short`` fit's steps are consistent with the ``long`` fit's ratio ``R``.

    Statistic ``T = mx_s − R·my_s = Σ v_s·e`` with ``e = x̃ − R·ỹ``. As ``Σ v_l·e = 0`` at ``R``, to first order
    ``T = Σ (v_s − ρ·v_l)·e`` with ``ρ = my_s/my_l`` and ``e`` taken at the true ratio, so
    ``Var T = σ²·(Σv_s² − 2ρ·Σv_s·v_l + ρ²·Σv_l²)``: the fits share their steps, hence the cross term
    (:func:`cross_product`). ``σ² = vxx − 2R·vxy + R²·vyy`` is the per-step variance of ``e`` (``test.noise``).
    Consistent when ``T² ≤ t²·Var T``: Fieller's test of ``R`` on the short fit, less the long fit's own noise.
    """
    r = long.summary.ratio
    vxx, vyy, vxy = test.noise
    sigma2 = max(vxx - 2.0 * r * vxy + r * r * vyy, 0.0)
    rho = short.my / long.my
    factor = (cross_product(short.kernel, short.kernel, test.decays, test.steps)
              - 2.0 * rho * cross_product(short.kernel, long.kernel, test.decays, test.steps)
              + rho * rho * cross_product(long.kernel, long.kernel, test.decays, test.steps))
    statistic = short.mx - r * short.my
    return statistic * statistic <= test.t * test.t * sigma2 * max(factor, 0.0)


def window_test(stream: Sequence[Sequence[float]], decays: Sequence[float], confidence: float
                ) -> Optional[WindowTest]:
    """The :class:`WindowTest` of one stream's per-window sums; None while the base trend is not identified.

    Its threshold is Bonferroni's over the checks a candidate faces (every shorter candidate: ``2·windows − 1``
    for the longest), so that at fixed parameters the choice reads the longest window with probability at least
    ``confidence``: each check at ``1 − (1 − confidence)/checks``.
    """
    moments = detrended_moments(stream[0])
    if moments is None:
        return None
    steps = steps_of(stream[-1], decays[-1])  # the longest window's d^n underflows last
    checks = 2 * len(stream) - 1
    return WindowTest(tuple(decays), steps, moments[:3], t_quantile(1.0 - (1.0 - confidence) / checks, moments[3]))


def fits_of_row(row: Sequence[float], confidence: float) -> list[TrendFit]:
    """One stream's candidates from its packed values (``windows × TREND_FIELDS`` sums, then the scale state
    ``(Σ d_s^k·scale, Σ d_s^k)``), from least to most smoothing: the trend fit then the level fit at the base
    window, then the same at each longer window."""
    stream = stream_of_row(row)
    total, count = row[-2:]
    scale = total / count if count > 0 else math.nan
    return [fit_window(sums, scale, confidence, trend, window) for window, sums in enumerate(stream)
            for trend in (True, False)]


def stream_of_row(row: Sequence[float]) -> list[Sequence[float]]:
    """Per window, its ``TREND_FIELDS`` sums, from one stream's packed values."""
    fields = len(TREND_FIELDS)
    return [row[k * fields:(k + 1) * fields] for k in range((len(row) - 2) // fields)]


def choose_fit(fits: Sequence[TrendFit], test: Optional[WindowTest] = None) -> RatioSummary:
    """The most smoothed fit the data cannot tell from the less smoothed ones (Lepski's rule), with the base trend
    fit's interval, which still covers when the choice was wrong; see the module docstring.

    ``fits`` in :func:`fits_of_row` order. The reading is the last candidate :func:`consistent` with every candidate
    before it (:func:`lepski_choice`). The chosen fit gives the ratio, the kernel means and ``effective_steps``; the
    interval is the base trend fit's, widened to hold the chosen ratio. The choice needs a base trend fit that
    resolves ``|G|²`` (:func:`resolves`) and a ``test`` (enough steps); without them, or when no candidate is
    consistent: :func:`fallback_fit`.
    """
    chosen = lepski_choice(fits, test) if test is not None and resolves(fits[0]) else None
    if chosen is None:
        return fallback_fit(fits, test)
    return with_base_interval(fits[0], chosen)


def with_base_interval(base: TrendFit, chosen: TrendFit) -> RatioSummary:
    """``chosen``'s reading with ``base``'s interval, widened to hold ``chosen``'s ratio."""
    ratio = chosen.summary.ratio
    return replace(chosen.summary, ci_low=min(base.summary.ci_low, ratio), ci_high=max(base.summary.ci_high, ratio))


def resolves(fit: TrendFit) -> bool:
    """A usable ratio with a bounded interval: the fit tells ``|G|²`` from zero, so its steps have power to see a
    longer window lag."""
    return fit.usable and math.isfinite(fit.summary.ci_high)


def lepski_choice(fits: Sequence[TrendFit], test: WindowTest) -> Optional[TrendFit]:
    """The last usable candidate consistent with every candidate before it (Lepski 1991: the largest window whose
    estimate the shorter ones cannot reject), or None. A candidate whose own ratio is not usable cannot be read,
    but its steps still check the longer ones."""
    chosen = None
    for k, fit in enumerate(fits):
        if fit.usable and consistent_with_shorter(fits, k, test):
            chosen = fit
    return chosen


def consistent_with_shorter(fits: Sequence[TrendFit], k: int, test: WindowTest) -> bool:
    """Whether every candidate before ``fits[k]`` (less smoothed) is :func:`consistent` with its ratio."""
    return all(consistent(earlier, fits[k], test) for earlier in fits[:k])


def fallback_fit(fits: Sequence[TrendFit], test: Optional[WindowTest] = None) -> RatioSummary:
    """The reading where no window was chosen: the base trend fit while its ratio is finite and positive, else the
    base level fit; where neither is, a longer level fit only if every shorter candidate is :func:`consistent` with
    it (with ``test``; Lepski's check), read with the base trend fit's interval; else the base trend fit (``inf``:
    ``|G|²`` not resolved).

    A longer window's own interval covers its own weighted mean, which lags a moving run: on a breast-cancer MLP
    under AdamW (exact ``B_simple`` 1,200 → 2,200) the 4× level fit read 110 [80, 170] while the base window could
    not resolve ``|G|²``; read with its own interval it was a confident, wrong number."""
    base_trend, base_level = fits[0], fits[1]
    for fit in (base_trend, base_level):
        if fit.usable:
            return fit.summary
    if test is None:
        return base_trend.summary
    for k in range(2, len(fits)):
        if not fits[k].trend and fits[k].usable and consistent_with_shorter(fits, k, test):
            return with_base_interval(base_trend, fits[k])
    return base_trend.summary


class LocalLinearRatio:
    """Recent ``B_simple`` that tracks a moving run: local-linear ratio fit on normalised steps (module docstring).

    A drop-in for :class:`gns_callback.smoothing.RatioAccumulator` as the meter's recent estimate. Everything stays
    on the device and nothing syncs with the host on :meth:`update`: a step is one small copy into a buffer, and
    every ``BLOCK`` steps (or when read) the buffer is folded into the sums in closed form (:func:`advance_sums`,
    :func:`block_sums`). :meth:`summary` copies to the host once.

    Args:
        decay: weight of the past in the base window, in ``[0, 1)`` (``0.99``: ``n_eff`` ≈ 199 steps). Trend and
            level-only fits there and at windows of 4× and 16× that are the candidates :func:`choose_fit` reads
            from, by the measured drift.
        scale_decay: decay of the short EMA of earlier steps' ``scale`` that normalises each step, in ``[0, 1)``.
        batch_shape: independent streams kept side by side (simulations); ``()`` for one.
    """

    def __init__(self, decay: float = 0.99, scale_decay: float = 0.8, batch_shape: Sequence[int] = ()) -> None:
        _check_decay("decay", decay, "e.g. 0.99 (about the last 200 steps)", upper_open=True)
        _check_decay("scale_decay", scale_decay, "e.g. 0.8 (about the last 9 steps)", upper_open=True)
        self.decay = float(decay)
        self.scale_decay = float(scale_decay)
        self.batch_shape = tuple(int(b) for b in batch_shape)
        n = window_for_decay(self.decay)
        self.decays = [decay_for_window(n * factor) for factor in WINDOW_FACTORS]
        self._decays = torch.tensor(self.decays, dtype=torch.float64)
        self._sums = torch.zeros(*self.batch_shape, len(self.decays), len(TREND_FIELDS), dtype=torch.float64)
        self._scale_state = torch.zeros(*self.batch_shape, 2, dtype=torch.float64)  # (Σ d_s^k·scale, Σ d_s^k)
        self._pending = torch.zeros(*self.batch_shape, BLOCK, 4, dtype=torch.float64)  # (x, y, scale, valid)
        self._buffered = 0

    # ------------------------------------------------------------------ per step, on the device
    def update(self, x: torch.Tensor, y: torch.Tensor, valid: torch.Tensor,
               scale: Optional[torch.Tensor] = None) -> None:
        """Add one step's ``x = tr Σ̂``, ``y = |Ĝ|²`` (shape ``batch_shape``); where ``valid`` is False, or an input
        is not finite, nothing changes.

        ``scale``: positive, proportional to the step's noise, e.g. the big-batch ``|G_B|²`` (``= y + x/B``);
        default ``|x| + |y|``.
        """
        x = x.to(torch.float64)
        self._to(x.device)
        y = y.to(torch.float64)
        scale = x.abs() + y.abs() if scale is None else torch.as_tensor(scale, device=x.device).to(torch.float64)
        parts = [x, y, scale, torch.as_tensor(valid, device=x.device).to(torch.float64)]
        if self.batch_shape:
            parts = torch.broadcast_tensors(*parts)
        self._pending.select(-2, self._buffered).copy_(torch.stack(parts, -1))
        self._buffered += 1
        if self._buffered == BLOCK:
            self._flush()

    def update_vector(self, step: torch.Tensor, valid: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        """:meth:`update` from a :func:`gns_callback.smoothing.step_vector` (``x``, ``y`` at entries 2 and 3)."""
        self.update(step[2], step[3], valid, scale)

    def update_values(self, x: float, y: float, valid: bool) -> None:
        """:meth:`update` of one stream from host floats (the state moves to the CPU): one write, no tensor op."""
        self._to(_CPU)
        self._pending.numpy()[self._buffered] = (x, y, abs(x) + abs(y), float(valid))
        self._buffered += 1
        if self._buffered == BLOCK:
            self._flush()

    def _flush(self) -> None:
        """Fold the buffered steps into the sums and the scale state (device only, no host sync)."""
        self._sums, self._scale_state = self._folded()
        self._buffered = 0

    def _folded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sums, scale_state)`` with the buffered steps folded in, leaving the buffer as it is (so reading never
        moves the block boundaries: a run reads the same numbers whether or not it was read or saved before)."""
        if not self._buffered:
            return self._sums, self._scale_state
        x, y, scale, valid = self._pending[..., : self._buffered, :].unbind(-1)
        ok = (valid > 0) & torch.isfinite(x + y + scale) & (scale > 0)
        mask = ok.to(torch.float64)
        scale = torch.where(ok, scale, 1.0)
        previous, scale_state = predictable_scales(scale, mask, self._scale_state, self.scale_decay)
        x_norm, y_norm = torch.where(ok, x / previous, 0.0), torch.where(ok, y / previous, 0.0)
        advanced = advance_sums(self._sums, self._decays, mask.sum(-1))
        return advanced + block_sums(x_norm, y_norm, mask, self._decays), scale_state

    @property
    def sums(self) -> torch.Tensor:
        """Every window's sums (``[*batch_shape, windows, TREND_FIELDS]``), the buffered steps included."""
        return self._folded()[0]

    @property
    def scale_state(self) -> torch.Tensor:
        """``(Σ d_s^k·scale, Σ d_s^k)`` of the normaliser's EMA, the buffered steps included."""
        return self._folded()[1]

    # ------------------------------------------------------------------ reading, on the host
    def summary(self, confidence: float = 0.95) -> RatioSummary:
        """The recent ratio and its interval (one device-to-host copy); see the module docstring.

        ``mean_x``, ``mean_y``: the chosen fit's kernel means of the normalised parts times the current scale,
        i.e. ``tr Σ`` and ``|G|²`` now (not averaged over the window); their ratio is ``ratio``.
        ``effective_steps``: ``(Σv)²/Σv²`` of the chosen fit's kernel.
        """
        if self.batch_shape:
            raise ValueError(f"summary() reads one stream; this tracker holds batch_shape={self.batch_shape}: "
                             "use summaries().")
        return self.summaries(confidence)[0]

    def summaries(self, confidence: float = 0.95) -> list[RatioSummary]:
        """:meth:`summary` of every stream, in row-major order of ``batch_shape`` (one device-to-host copy)."""
        rows = self.packed().reshape(-1, self.packed_size).tolist()
        return [self._choose(row, confidence) for row in rows]

    def fits(self, confidence: float = 0.95) -> list[list[TrendFit]]:
        """Per stream, the candidates in the order :func:`choose_fit` tries them: the trend fit then the level-only
        fit, at each window (base, 4×, 16×)."""
        return [fits_of_row(row, confidence) for row in self.packed().reshape(-1, self.packed_size).tolist()]

    @property
    def packed_size(self) -> int:
        """Entries per stream in :meth:`packed`: every window's ``TREND_FIELDS`` sums, then the scale state."""
        return len(self.decays) * len(TREND_FIELDS) + 2

    def packed(self) -> torch.Tensor:
        """Everything a reading needs, on the device (``[*batch_shape, packed_size]``): copy it to the host along
        with other values in one transfer, then read it with :meth:`summary_of`."""
        sums, scale_state = self._folded()
        return torch.cat([sums.flatten(-2), scale_state], -1)

    def summary_of(self, row: Sequence[float], confidence: float = 0.95) -> RatioSummary:
        """:meth:`summary` from one stream's :meth:`packed` values already on the host (no device access)."""
        if len(row) != self.packed_size:
            raise ValueError(f"row has {len(row)} values; a packed stream of this tracker has {self.packed_size}.")
        return self._choose(row, confidence)

    def _choose(self, row: Sequence[float], confidence: float) -> RatioSummary:
        return choose_fit(fits_of_row(row, confidence), window_test(stream_of_row(row), self.decays, confidence))

    def state_dict(self) -> dict:
        """Plain types only (checkpoints load with ``weights_only=True``); the buffered steps are kept as they are,
        so a resumed run folds them in at the same step as an uninterrupted one (bit-identical readings)."""
        return {"decay": self.decay, "scale_decay": self.scale_decay, "batch_shape": list(self.batch_shape),
                "sums": self._sums.tolist(), "scale_state": self._scale_state.tolist(),
                "pending": _invalid_where_not_finite(self._pending[..., : self._buffered, :]).tolist()}

    def load_state_dict(self, state: dict) -> None:
        device = self._sums.device
        fresh = LocalLinearRatio(float(state["decay"]), float(state["scale_decay"]), state.get("batch_shape", ()))
        fresh._sums = torch.tensor(state["sums"], dtype=torch.float64)
        fresh._scale_state = torch.tensor(state["scale_state"], dtype=torch.float64)
        pending = torch.tensor(state.get("pending", []), dtype=torch.float64)
        fresh._buffered = pending.shape[-2] if pending.dim() >= 2 else 0
        if fresh._buffered:
            fresh._pending[..., : fresh._buffered, :] = pending
        fresh._to(device)
        self.__dict__.update(fresh.__dict__)

    def _to(self, device: torch.device) -> None:
        if self._sums.device != device:
            self._sums, self._scale_state = self._sums.to(device), self._scale_state.to(device)
            self._pending, self._decays = self._pending.to(device), self._decays.to(device)


def _invalid_where_not_finite(pending: torch.Tensor) -> torch.Tensor:
    """Buffered steps with a non-finite entry (never folded in) written as a plain invalid step ``(0, 0, 1, 0)``, so
    saved states hold no NaN and compare equal."""
    finite = torch.isfinite(pending).all(-1, keepdim=True)
    return torch.where(finite, pending, torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=pending.dtype, device=pending.device))


def _check_decay(name: str, value: float, hint: str, upper_open: bool, lower_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > 0.0 if lower_open else value >= 0.0) and (value < 1.0 if upper_open else value <= 1.0)
    if not ok:
        low = "(0" if lower_open else "[0"
        raise ValueError(f"{name}={value!r}: a number in {low}, 1), {hint}.")


__all__ = ["LocalLinearRatio", "TrendFit", "Kernel", "WindowTest", "TREND_FIELDS", "WINDOW_FACTORS", "BLOCK",
           "fit_window", "fits_of_row", "stream_of_row", "window_test", "choose_fit", "resolves", "lepski_choice",
           "fallback_fit", "consistent", "cross_product", "power_sums", "steps_of", "detrended_moments",
           "level_moments", "advance_sums", "block_sums", "predictable_scales", "decay_for_window", "window_for_decay"]
