"""Trajectory tracking: the recent B_simple against the exact value at every step of real SGD/Adam runs.

For each case (scikit-learn data sets, bundled, offline) and seed, the model is trained with batches of 32 drawn
with replacement. At every step the exact ``B_simple = tr Σ/|G|²`` of the current parameters is computed by brute
force over the whole data set (``gns_callback.exact``), and the same per-example gradients give each measurement
replica's per-step unbiased estimates ``tr Σ̂`` and ``|Ĝ|²`` for a fresh batch of 32 (replica 0 is the batch the
optimizer steps on): with ``per_example`` (b = 1, every example) and ``micro_batch`` (4 micro-batches of 8).

Recent estimators compared, each read at the same steps:

* ``EMA of parts (previous meter)``: the meter's recent estimate before state version 3, separate EMAs (decay
  0.99) of ``tr Σ̂`` and ``|Ĝ|²``, read with ``gns_callback.smoothing.summarize_ratio``; and the same EMA of the
  *exact* parts (no noise);
* ``ratio-scale EMA``: steps normalised by a short EMA of ``|x| + |y|`` before the EMA (``LocalLinearRatio``'s
  level-only fit at its base window);
* ``drift-chosen window``: ratio-scale EMAs at n_eff = 8 … 2048, the longest window whose Fieller interval meets
  every shorter one (intersection of confidence intervals, Goldenshluger & Nemirovski 1997);
* ``log-parts filter``: an extended Kalman filter on ``log tr Σ`` and on ``log |G|²`` (random-walk level, process
  variance q per step, two values), each step's observation noise sd = its scale times the RMS of earlier
  ``v/scale``;
* ``LocalLinearRatio``: ``gns_callback.tracking`` (the chosen estimator: trend and level fits at windows 1×, 4×,
  16× the base, the most smoothed one the data cannot tell from the less smoothed ones, Lepski's rule), and its
  reading before that window choice (the base-window trend fit, the level where that does not resolve |G|²);
* ``GradientNoiseScaleMeter.estimate``: the meter itself at its defaults (``per_example``, which measures every
  example of these models' batches of 32, ``ema_decay`` 0.99), hooked on the model and stepped on the optimizer's batch (replica 0), end to end.

Scores over steps ≥ 50 (as in issue 14): geometric mean of estimate/exact over readings that are finite and
positive, the share of readings that are not (unresolved: ``inf``/0), the typical per-step error factor
``exp(mean |log(estimate/exact)|)``, and how often the interval holds the exact value (nominal 95%).

    python benchmarks/trajectory_tracking.py --out benchmarks/RESULTS.md   # about 6 CPU-minutes
    python benchmarks/trajectory_tracking.py --quick                       # smoke test, < 1 min
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits, load_wine  # noqa: E402

from benchmarks.results import replace_section  # noqa: E402
from gns_callback.estimators import grad_sq_norm_estimate, trace_sigma_estimate  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from gns_callback.meter import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.smoothing import summarize_ratio  # noqa: E402
from gns_callback.tracking import LocalLinearRatio, fallback_fit  # noqa: E402

HEADING = "## Trajectory tracking: the recent estimate on a moving run (issue 14 item 2)"
BATCH, MICRO, WIDE = 32, 8, 256
METER = "meter at its defaults (per_example)"
DECAY = 0.99
START = 50
LOCAL = 21  # steps in the local value: exact tr Σ and |G|² averaged over the last 21 steps
PHASES = ((50, 100), (100, 200), (200, 400), (400, 10**9))


# ---------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    name: str
    data: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    model: Callable[[], nn.Module]
    loss: Callable
    optimizer: Callable[[list], torch.optim.Optimizer]
    steps: int


def _standardise(a) -> torch.Tensor:
    a = torch.tensor(a, dtype=torch.float32)
    return (a - a.mean(0)) / (a.std(0) + 1e-8)


def _digits():
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def _breast_cancer():
    data = load_breast_cancer()
    return _standardise(data.data), torch.tensor(data.target)


def _wine():
    data = load_wine()
    return _standardise(data.data), torch.tensor(data.target)


def _diabetes():
    data = load_diabetes()
    return _standardise(data.data), _standardise(data.target[:, None])


CASES = [
    Case("digits MLP 64-32-10, SGD lr 0.1", _digits,
         lambda: nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)), F.cross_entropy,
         lambda p: torch.optim.SGD(p, lr=0.1), 800),
    Case("breast-cancer logistic regression, SGD lr 0.1", _breast_cancer, lambda: nn.Linear(30, 2),
         F.cross_entropy, lambda p: torch.optim.SGD(p, lr=0.1), 300),
    Case("wine MLP 13-16-3, SGD lr 0.05 momentum 0.9", _wine,
         lambda: nn.Sequential(nn.Linear(13, 16), nn.Tanh(), nn.Linear(16, 3)), F.cross_entropy,
         lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), 500),
    Case("diabetes MLP 10-32-1 regression (MSE), Adam lr 1e-3", _diabetes,
         lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1)), F.mse_loss,
         lambda p: torch.optim.Adam(p, lr=1e-3), 400),
    Case("digits MLP 64-32-10, fixed parameters (lr 0)", _digits,
         lambda: nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)), F.cross_entropy,
         lambda p: torch.optim.SGD(p, lr=0.0), 400),
]


# ---------------------------------------------------------------------------------------------- simulation
@dataclass
class Trajectory:
    """exact: (T, 3) = (B_simple, |G|², tr Σ); per method, (T, R, 2) = per-step (tr Σ̂, |Ĝ|²) per replica;
    meter: (T, 3) = the meter's recent estimate and interval after each step (replica 0)."""

    exact: np.ndarray
    measured: dict[str, np.ndarray]
    meter: np.ndarray


def _pair(small: torch.Tensor, big: torch.Tensor, b_small: float, b_big: float) -> np.ndarray:
    return torch.stack([trace_sigma_estimate(small, big, b_small, b_big),
                        grad_sq_norm_estimate(small, big, b_small, b_big)], -1).numpy()


def _step_estimates(rows: torch.Tensor, wide_rows: torch.Tensor) -> dict[str, np.ndarray]:
    """(tr Σ̂, |Ĝ|²) per replica from its batch's per-example gradients ``rows`` (R, 32, P): ``per_example``
    (b = 1) and ``micro_batch`` (4 × 8); and ``per_example`` on a wider batch ``wide_rows`` (R, 256, P), which
    measures the same trajectory with 8× less noise in |Ĝ|²."""
    big = rows.mean(1).pow(2).sum(-1)
    micro_sq = rows.reshape(rows.shape[0], BATCH // MICRO, MICRO, -1).mean(2).pow(2).sum(-1).mean(-1)
    return {"per_example": _pair(rows.pow(2).sum(-1).mean(-1), big, 1, BATCH),
            "micro_batch": _pair(micro_sq, big, MICRO, BATCH),
            f"per_example, {WIDE} examples": _pair(wide_rows.pow(2).sum(-1).mean(-1),
                                                   wide_rows.mean(1).pow(2).sum(-1), 1, WIDE)}


def simulate(case: Case, seed: int, replicas: int, steps: int) -> Trajectory:
    """Train ``steps`` steps; exact value and every replica's step estimates at each step."""
    x, y = case.data()
    torch.manual_seed(seed)
    model = case.model()
    optimizer = case.optimizer(list(model.parameters()))
    draws = torch.Generator().manual_seed(10_000 + seed)
    fixed = all(group["lr"] == 0.0 for group in optimizer.param_groups)
    exact, meter_readings = np.zeros((steps, 3)), np.zeros((steps, 3))
    measured: dict[str, np.ndarray] = {}
    rows = None
    with GradientNoiseScaleMeter(model) as meter:
        for t in range(steps):
            if rows is None or not fixed:
                with meter.paused():
                    rows = per_example_gradients(model, case.loss, x, y)
                exact[t] = exact_noise_scale(rows)
            else:
                exact[t] = exact[t - 1]
            index = torch.randint(0, x.shape[0], (replicas, BATCH), generator=draws)
            wide = torch.randint(0, x.shape[0], (replicas, WIDE), generator=draws)
            for method, values in _step_estimates(rows[index], rows[wide]).items():
                measured.setdefault(method, np.zeros((steps, replicas, 2)))[t] = values
            optimizer.zero_grad()
            case.loss(model(x[index[0]]), y[index[0]]).backward()
            meter.step()
            optimizer.step()
            if t >= START:
                reading = meter.estimate
                meter_readings[t] = reading.b_simple, reading.ci_low, reading.ci_high
    return Trajectory(exact, measured, meter_readings)


# ---------------------------------------------------------------------------------------------- estimators
Readings = tuple[np.ndarray, np.ndarray, np.ndarray]  # estimate, ci_low, ci_high: (T, R), NaN where not read


def _empty(shape) -> list[np.ndarray]:
    return [np.full(shape, np.nan) for _ in range(3)]


def ema_of_parts(x: np.ndarray, y: np.ndarray, read: np.ndarray, decay: float = DECAY) -> Readings:
    """The previous meter's recent estimate: EMA sums (``SUM_FIELDS``) of each stream, read with ``summarize_ratio``."""
    out = _empty(x.shape)
    sums = np.zeros(x.shape[1:] + (7,))
    weights = np.array([decay, decay * decay] + [decay] * 5)
    for t in range(x.shape[0]):
        one = np.ones_like(x[t])
        sums = sums * weights + np.stack([one, one, x[t], y[t], x[t] ** 2, y[t] ** 2, x[t] * y[t]], -1)
        if read[t]:
            for r in range(x.shape[1]):
                s = summarize_ratio(sums[r])
                out[0][t, r], out[1][t, r], out[2][t, r] = s.ratio, s.ci_low, s.ci_high
    return tuple(out)


BEFORE = "LocalLinearRatio before the window choice (base-window trend fit, level fallback)"


def local_linear(x: np.ndarray, y: np.ndarray, read: np.ndarray, decay: float = DECAY) -> dict[str, Readings]:
    """``LocalLinearRatio`` (the chosen reading), its reading before the window was chosen by the measured drift
    (``fallback_fit``: the base-window trend fit while it resolves |G|², else the level), and its level-only fit."""
    replicas = x.shape[1]
    tracker = LocalLinearRatio(decay, batch_shape=(replicas,))
    names = ("LocalLinearRatio", BEFORE, "ratio-scale EMA")
    out = {name: _empty(x.shape) for name in names}
    valid = torch.ones(replicas, dtype=torch.bool)
    xs, ys = torch.from_numpy(x), torch.from_numpy(y)
    for t in range(x.shape[0]):
        tracker.update(xs[t], ys[t], valid)
        if not read[t]:
            continue
        for r, (fits, chosen) in enumerate(zip(tracker.fits(), tracker.summaries())):
            for name, s in zip(names, (chosen, fallback_fit(fits), fits[1].summary)):
                out[name][0][t, r], out[name][1][t, r], out[name][2][t, r] = s.ratio, s.ci_low, s.ci_high
    return {name: tuple(v) for name, v in out.items()}


def _predictable_scale(x: np.ndarray, y: np.ndarray, decay: float = 0.8) -> np.ndarray:
    """EMA of earlier steps' ``|x| + |y|`` (the first step's own at step one), as ``LocalLinearRatio`` uses."""
    scale = np.abs(x) + np.abs(y)
    previous = np.empty_like(scale)
    total, count = np.zeros(x.shape[1:]), 0.0
    for t in range(x.shape[0]):
        previous[t] = scale[t] if t == 0 else total / count
        total, count = decay * total + scale[t], decay * count + 1.0
    return previous


def drift_chosen_window(x: np.ndarray, y: np.ndarray, read: np.ndarray,
                        windows=(8, 16, 32, 64, 128, 256, 512, 1024, 2048)) -> Readings:
    """Ratio-scale EMAs at several ``n_eff``; the longest whose interval meets all shorter ones (ICI rule)."""
    scale = _predictable_scale(x, y)
    xn, yn = x / scale, y / scale
    decays = np.array([(n - 1.0) / (n + 1.0) for n in windows])
    sums = np.zeros((len(windows),) + x.shape[1:] + (7,))
    weights = np.stack([decays, decays**2] + [decays] * 5, -1)[:, None, :]
    out = _empty(x.shape)
    for t in range(x.shape[0]):
        one = np.ones_like(xn[t])
        sums = sums * weights + np.stack([one, one, xn[t], yn[t], xn[t] ** 2, yn[t] ** 2, xn[t] * yn[t]], -1)
        if not read[t]:
            continue
        for r in range(x.shape[1]):
            low, high, chosen = 0.0, math.inf, None
            for k in range(len(windows)):
                s = summarize_ratio(sums[k, r])
                low, high = max(low, s.ci_low), min(high, s.ci_high)
                if low > high:
                    break
                chosen = s
            out[0][t, r], out[1][t, r], out[2][t, r] = chosen.ratio, chosen.ci_low, chosen.ci_high
    return tuple(out)


def _ekf_log_level(v: np.ndarray, noise_sd: np.ndarray, q: float) -> tuple[np.ndarray, np.ndarray]:
    """Extended Kalman filter, random-walk level on ``log E v`` (process variance ``q`` per step), observation
    ``v = exp(level) + ε``, ``sd(ε) = noise_sd``. Returns the level and its variance at every step.

    (A local linear trend state on top, tried first, diverged on these runs.)
    """
    level, p = np.log(np.maximum(np.abs(v[0]), 1e-30)), np.full(v.shape[1:], 4.0)
    levels, variances = np.empty_like(v), np.empty_like(v)
    for t in range(v.shape[0]):
        p = p + q if t else p
        h = np.exp(level)
        gain = p * h / (p * h * h + noise_sd[t] ** 2)
        level = np.clip(level + gain * (v[t] - h), -700, 700)
        p = p - gain * h * p
        levels[t], variances[t] = level, p
    return levels, variances


def _noise_sd(v: np.ndarray, scale: np.ndarray, decay: float = 0.99) -> np.ndarray:
    """Each step's observation noise sd: ``scale_t`` times the RMS of earlier ``v/scale`` (predictable)."""
    ratio_sq = (v / scale) ** 2
    out = np.empty_like(v)
    total, count = np.zeros(v.shape[1:]), 0.0
    for t in range(v.shape[0]):
        out[t] = scale[t] * np.sqrt(ratio_sq[t] if t == 0 else total / count)
        total, count = decay * total + ratio_sq[t], decay * count + 1.0
    return out


def log_parts_filter(x: np.ndarray, y: np.ndarray, read: np.ndarray, q: float) -> Readings:
    """``exp(log X̂ − log Ŷ)`` from two EKFs (one per log part); its 95% interval from the filters' variances."""
    scale = _predictable_scale(x, y)
    log_x, var_x = _ekf_log_level(x, _noise_sd(x, scale), q)
    log_y, var_y = _ekf_log_level(y, _noise_sd(y, scale), q)
    estimate = np.exp(np.clip(log_x - log_y, -700, 700))
    half = 1.96 * np.sqrt(var_x + var_y)
    out = _empty(x.shape)
    for array, values in zip(out, (estimate, estimate * np.exp(-half), estimate * np.exp(half))):
        array[read] = values[read]
    return tuple(out)


# ---------------------------------------------------------------------------------------------- scores
def local_value(exact: np.ndarray, steps: int = LOCAL) -> np.ndarray:
    """Exact ratio of the exact parts' means over the last ``steps`` steps: (T,) from exact (T, 3)."""
    cumulative = np.cumsum(exact[:, 1:], axis=0)
    lagged = np.vstack([np.zeros((steps, 2)), cumulative[:-steps]])
    sums = cumulative - lagged
    return sums[:, 1] / sums[:, 0]


def score(readings: Readings, exact: np.ndarray, local: np.ndarray, start: int = START,
          end: int = 10**9) -> dict[str, float]:
    """Readings (T, R) of steps in ``[start, end)`` against the exact instantaneous value ``exact`` (T,) and the
    local value ``local`` (T,)."""
    estimate, low, high = (a[start:end] for a in readings)
    truth = np.broadcast_to(exact[start:end, None], estimate.shape)
    recent = np.broadcast_to(local[start:end, None], estimate.shape)
    read = ~np.isnan(estimate)
    estimate, low, high, truth, recent = estimate[read], low[read], high[read], truth[read], recent[read]
    resolved = np.isfinite(estimate) & (estimate > 0)
    logs = np.log(estimate[resolved] / truth[resolved])
    return {
        "gm": float(np.exp(logs.mean())) if logs.size else math.nan,
        "unresolved": float(1.0 - resolved.mean()) if resolved.size else math.nan,
        "error": float(np.exp(np.abs(logs).mean())) if logs.size else math.nan,
        "coverage": float(np.mean((low <= truth) & (truth <= high))) if truth.size else math.nan,
        "local_coverage": float(np.mean((low <= recent) & (recent <= high))) if truth.size else math.nan,
        "readings": int(truth.size),
    }


def pooled(scores: list[dict[str, float]]) -> dict[str, float]:
    """Scores of several trajectories pooled, weighting each by its number of readings (gm in log space)."""
    n = np.array([s["readings"] for s in scores], dtype=float)
    resolved = n * (1 - np.array([s["unresolved"] for s in scores]))
    out = {"readings": int(n.sum()), "unresolved": float(1 - resolved.sum() / n.sum())}
    for key in ("coverage", "local_coverage"):
        out[key] = float(np.sum(n * np.array([s[key] for s in scores])) / n.sum())
    for key in ("gm", "error"):
        logs = np.log(np.array([s[key] for s in scores]))
        out[key] = float(np.exp(np.nansum(resolved * logs) / resolved.sum()))
    return out


# ---------------------------------------------------------------------------------------------- run
def estimators(x: np.ndarray, y: np.ndarray, read: np.ndarray) -> dict[str, Readings]:
    out = {"EMA of parts (previous meter, decay 0.99)": ema_of_parts(x, y, read)}
    out.update(local_linear(x, y, read))
    out["drift-chosen window (ICI, n_eff 8–2048)"] = drift_chosen_window(x, y, read)
    for q in (1e-3, 1e-2):
        out[f"log-parts filter (EKF, q = {q:g})"] = log_parts_filter(x, y, read, q)
    return out


def meter_readings(meter: np.ndarray, read: np.ndarray) -> Readings:
    """The meter's (T, 3) readings as :data:`Readings` of one replica, NaN where not read."""
    out = _empty((meter.shape[0], 1))
    for array, column in zip(out, meter.T):
        array[read, 0] = column[read]
    return tuple(out)


def evaluate(case: Case, seeds: int, replicas: int, steps: int, every: int) -> dict:
    """Per method and estimator: pooled scores over steps ≥ 50, per-phase geometric means, exact range."""
    results: dict = {"case": case.name, "steps": steps, "methods": {}, "noise_free": [], "exact": [], "jitter": []}
    per_method: dict = {}
    for seed in range(seeds):
        trajectory = simulate(case, seed, replicas, steps)
        exact, local = trajectory.exact[:, 0], local_value(trajectory.exact)
        results["exact"].append(exact)
        results["jitter"].append(np.abs(np.diff(np.log(exact[START:]))))
        read = (np.arange(steps) >= START) & (np.arange(steps) % every == 0)
        noise_free = ema_of_parts(trajectory.exact[:, 2:3], trajectory.exact[:, 1:2], read)
        results["noise_free"].append(score(noise_free, exact, local))
        by_method = {method: estimators(values[..., 0], values[..., 1], read)
                     for method, values in trajectory.measured.items()}
        by_method[METER] = {"GradientNoiseScaleMeter.estimate": meter_readings(trajectory.meter, read)}
        for method, by_name in by_method.items():
            for name, readings in by_name.items():
                entry = per_method.setdefault(method, {}).setdefault(name, {"all": [], "phases": []})
                entry["all"].append(score(readings, exact, local))
                entry["phases"].append([score(readings, exact, local, a, b) for a, b in PHASES])
    for method, by_name in per_method.items():
        results["methods"][method] = {
            name: {"all": pooled(v["all"]),
                   "phases": [pooled([p[i] for p in v["phases"]]) if any(p[i]["readings"] for p in v["phases"])
                              else None for i in range(len(PHASES))]}
            for name, v in by_name.items()}
    results["noise_free"] = pooled(results["noise_free"])
    return results


# ---------------------------------------------------------------------------------------------- report
def _fmt(value: float, digits: int = 2) -> str:
    return "—" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _exact_range(exacts: list[np.ndarray], a: int, b: int) -> str:
    values = np.concatenate([e[a:b] for e in exacts])
    return f"{values.min():.0f}–{values.max():.0f}" if values.size else "—"


def case_markdown(result: dict) -> list[str]:
    exact_at = [np.mean([e[i] for e in result["exact"]]) for i in (START, result["steps"] - 1)]
    lines = [f"### {result['case']} ({result['steps']} steps; exact B_simple {exact_at[0]:.0f} at step {START} → "
             f"{exact_at[1]:.0f} at the end, mean over seeds)", "",
             f"Noise-free EMA of the exact parts (decay 0.99): geometric mean {_fmt(result['noise_free']['gm'])}×. "
             f"The exact value itself moves by a median {np.median(np.concatenate(result['jitter'])):.1%} from one "
             "step to the next (parameter noise).", "",
             "| measured with | estimator | gm estimate/exact | unresolved | typical error × | interval holds exact | "
             "interval holds local value |", "|---|---|---|---|---|---|---|"]
    for method, by_name in result["methods"].items():
        for name, v in by_name.items():
            a = v["all"]
            lines.append(f"| {method} | {name} | {_fmt(a['gm'])} | {a['unresolved']:.1%} | {_fmt(a['error'])} | "
                         f"{a['coverage']:.1%} | {a['local_coverage']:.1%} |")
    phases = [(a, min(b, result["steps"])) for a, b in PHASES if a < result["steps"]]
    head = " | ".join(f"steps {a}–{b} [{_exact_range(result['exact'], a, b)}]" for a, b in phases)
    lines += ["", "Geometric mean of estimate/exact by phase (`per_example` on every example, then the meter; exact "
              "range over seeds in brackets):", "", "| estimator | " + head + " |", "|---|" + "---|" * len(phases)]
    rows = list(result["methods"]["per_example"].items()) + list(result["methods"].get(METER, {}).items())
    for name, v in rows:
        cells = " | ".join(_fmt(p["gm"]) if p else "—" for p in v["phases"][: len(phases)])
        lines.append(f"| {name} | {cells} |")
    return lines + [""]


def to_markdown(results: list[dict], command: str, seconds: tuple[float, float], seeds: int, replicas: int,
                every: int) -> str:
    lines = [
        f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (shared), torch {torch.__version__}, one thread; {seconds[0] / 60:.1f} min wall, "
        f"{seconds[1] / 60:.1f} min CPU. "
        f"{seeds} trajectory seeds × {replicas} measurement replicas (replica 0 = the optimizer's batch), batch "
        f"{BATCH} drawn with replacement, read every {every} steps from step {START}. Exact B_simple at every step "
        "by brute force over the whole data set (`gns_callback.exact`). gm = geometric mean of estimate/exact over "
        "resolved readings; unresolved = readings of `inf` or 0 (|G|² or tr Σ estimated ≤ 0); typical error = "
        "exp(mean |log(estimate/exact)|); interval = 95% (nominal); local value = ratio of the exact tr Σ and |G|² "
        f"averaged over the last {LOCAL} steps. Measured with: `per_example` (b = 1) and `micro_batch` (4 × 8) on "
        f"the batch of {BATCH}; `per_example, {WIDE} examples`: the same trajectory measured on {WIDE} examples "
        "(8× less noise in |Ĝ|²), to see what the interval covers when the measurement is precise.",
        "",
    ]
    for result in results:
        lines += case_markdown(result)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two short cases, one seed, few replicas")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=6)
    parser.add_argument("--every", type=int, default=3, help="read the estimators every N steps")
    parser.add_argument("--out", help="replace this benchmark's section of this markdown file (RESULTS.md)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases, seeds, replicas, every = CASES, args.seeds, args.replicas, args.every
    if args.quick:
        cases = [Case(c.name, c.data, c.model, c.loss, c.optimizer, 120) for c in CASES[:2]]
        seeds, replicas, every = 1, 3, 5
    started, cpu = time.perf_counter(), time.process_time()
    results = []
    for case in cases:
        results.append(evaluate(case, seeds, replicas, case.steps, every))
        print(case_markdown(results[-1])[0], f"({time.perf_counter() - started:.0f} s)", flush=True)
    command = "python benchmarks/trajectory_tracking.py" + (" --quick" if args.quick else "")
    elapsed = (time.perf_counter() - started, time.process_time() - cpu)
    text = to_markdown(results, command, elapsed, seeds, replicas, every)
    print(text)
    if args.out:
        replace_section(args.out, HEADING, text)


if __name__ == "__main__":
    main()
