"""Critical batch size measured on real data (scikit-learn's digits) against the callback's B_simple.

McCandlish, Kaplan, Amodei 2018 ("An Empirical Model of Large-Batch Training", section 2.2, Fig. 7 and
appendix): for a sweep of batch sizes B, tune the learning rate per B and count the optimizer steps S(B) to
first reach a target training loss; with E(B) = B·S(B) examples, fit S = S_min(1 + B_crit/B), i.e.
(S/S_min − 1)(E/E_min − 1) = 1, and read B_crit = E_min/S_min. Along the way the callback
(``GradientNoiseScaleCallback(method="per_example")``) measures B_simple in Lightning runs that replay the same
batches, and ``recommend(cb.run_estimate, ...)`` is placed on the measured curve.

Setup: MLP 64-128-10 (tanh), one fixed initialisation; plain SGD (no momentum, no weight decay, constant LR);
1500 training examples; batches drawn i.i.d. with replacement; the loss is the full training-set
cross-entropy, evaluated every few steps, with the crossing of the target interpolated in log-loss.

    python benchmarks/critical_batch_digits.py [--out benchmarks/RESULTS.md]   # full run, ~6-9 min on 2 cores
    python benchmarks/critical_batch_digits.py --quick                        # < 30 s, for the smoke test
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bcrit.problems import digits as load_data  # noqa: E402
from benchmarks.bcrit.training import batch_indices, crossing, full_loss  # noqa: E402

warnings.filterwarnings("ignore")

SECTION_HEADING = "## Critical batch size on digits (McCandlish et al. measurement)"
FIGURE = os.path.join("benchmarks", "figures", "critical_batch_digits.png")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------------------ configuration
@dataclass(frozen=True)
class Config:
    batch_sizes: tuple[int, ...] = (4, 8, 16, 32, 64, 128, 256, 512)
    #: Log grid, factor √2; each B tries all of them (slow ones are cut early, see ``prune_factor``).
    lrs: tuple[float, ...] = tuple(round(0.05 * 2 ** (k / 2), 4) for k in range(11))  # 0.05 … 1.6
    target_loss: float = 0.03
    #: Shallower targets read off the same seed-0 runs (LR re-tuned per target): how B_crit moves with the loss.
    extra_targets: tuple[float, ...] = (0.3, 0.1)
    seeds: int = 4  # data-order seeds at the tuned LR and its grid neighbours (seed 0 also runs the whole grid)
    max_examples: int = 1_500_000  # per run: step budget = max_examples / B, capped below
    max_steps: int = 30_000
    prune_factor: float = 1.5  # a seed-0 run is cut once it is this much slower than the best LR so far
    diverge_factor: float = 2.0  # ... or once its loss exceeds this multiple of the initial loss (diverged)
    evals_per_run: int = 150  # roughly: evaluation every max(1, round(S_guess/evals)) steps
    hidden: int = 128
    train_size: int = 1500
    callback_batches: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    primary_batch: int = 32  # the run whose estimate goes into recommend()
    exact_batches: tuple[int, ...] = (32, 512)  # exact B_simple / B_noise at checkpoints along these runs
    exact_checkpoints: int = 16
    hvp_examples: int = 128  # examples for tr(HΣ) (an unbiased subsample)
    bootstrap: int = 2000


QUICK = Config(
    batch_sizes=(8, 64, 512),
    lrs=(0.2, 0.8),
    target_loss=0.5,
    extra_targets=(1.0,),
    seeds=2,
    max_examples=200_000,
    max_steps=1500,
    evals_per_run=60,
    callback_batches=(64,),
    primary_batch=64,
    exact_batches=(64,),
    exact_checkpoints=2,
    hvp_examples=32,
    bootstrap=200,
)


# ------------------------------------------------------------------------------------------------ data and model
def make_net(hidden: int = 128, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))


@dataclass
class RunResult:
    batch_size: int
    lr: float
    seed: int
    steps: dict[float, float]  # target -> interpolated steps to first reach it (inf: not reached)
    status: str  # "reached", "diverged", "cut" (slower than the best so far), "budget"
    steps_run: int
    final_loss: float


def train_to_targets(
    data: tuple[torch.Tensor, torch.Tensor],
    cfg: Config,
    batch_size: int,
    lr: float,
    seed: int,
    targets: tuple[float, ...],
    max_steps: int,
    eval_every: int,
    cut_after: float = math.inf,
    checkpoint_steps: tuple[int, ...] = (),
    on_checkpoint: Optional[Callable[[int, nn.Module], None]] = None,
) -> RunResult:
    """Plain SGD from the fixed init; stop when the deepest target is reached (or cut/diverged/out of budget)."""
    x, y = data
    net = make_net(cfg.hidden)
    opt = torch.optim.SGD(net.parameters(), lr=lr)
    deepest = min(targets)
    found: dict[float, float] = {}
    prev = (0, full_loss(net, x, y))
    initial = prev[1]
    status, step = "budget", 0
    checkpoints = set(checkpoint_steps)
    if on_checkpoint and 0 in checkpoints:
        on_checkpoint(0, net)
    for step, idx in enumerate(batch_indices(len(x), batch_size, seed), start=1):
        if step > max_steps:
            step = max_steps
            break
        loss = F.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if on_checkpoint and step in checkpoints:
            on_checkpoint(step, net)
        if step % eval_every and step != max_steps:
            continue
        cur = (step, full_loss(net, x, y))
        if not math.isfinite(cur[1]) or cur[1] > cfg.diverge_factor * initial:
            status = "diverged"
            break
        for t in targets:
            if t not in found and cur[1] <= t:
                found[t] = crossing(prev, cur, t)
        prev = cur
        if deepest in found:
            status = "reached"
            if not (on_checkpoint and checkpoints and step < max(checkpoints)):
                break
        elif step > cut_after:
            status = "cut"
            break
    steps = {t: found.get(t, math.inf) for t in targets}
    return RunResult(batch_size, lr, seed, steps, status, step, prev[1])


def eval_every_for(cfg: Config, expected_steps: float) -> int:
    return max(1, int(round(expected_steps / cfg.evals_per_run)))


# ------------------------------------------------------------------------------------------------ the LR sweep
@dataclass
class BatchResult:
    batch_size: int
    grid: list[RunResult]  # seed 0 over the LR grid
    tuned_lr: float
    seed_steps: dict[float, list[float]]  # lr -> steps to the target per seed (candidates only)
    extra: dict[float, tuple[float, float]] = field(default_factory=dict)  # target -> (lr, steps) from seed 0

    @property
    def steps(self) -> float:
        return float(np.mean(self.seed_steps[self.tuned_lr]))

    @property
    def steps_sd(self) -> float:
        v = self.seed_steps[self.tuned_lr]
        return float(np.std(v, ddof=1)) if len(v) > 1 else math.nan


def sweep(data, cfg: Config, log: Callable[[str], None] = print) -> list[BatchResult]:
    targets = tuple(sorted({cfg.target_loss, *cfg.extra_targets}, reverse=True))
    results = []
    guess = 4000.0  # steps expected at the smallest batch (only sets the evaluation interval)
    for b in cfg.batch_sizes:
        t0 = time.time()
        budget = min(cfg.max_steps, cfg.max_examples // b)
        every = eval_every_for(cfg, guess)
        best = math.inf
        grid: list[RunResult] = []
        for lr in sorted(cfg.lrs, reverse=True):  # large LRs first: fast, or diverge quickly
            r = train_to_targets(data, cfg, b, lr, 0, targets, budget, every, cut_after=cfg.prune_factor * best)
            grid.append(r)
            best = min(best, r.steps[cfg.target_loss])
        grid.sort(key=lambda r: r.lr)
        finite = [r for r in grid if math.isfinite(r.steps[cfg.target_loss])]
        if not finite:
            raise RuntimeError(f"batch {b}: no learning rate reached loss {cfg.target_loss} within {budget} steps")
        i_best = min(range(len(grid)), key=lambda i: grid[i].steps[cfg.target_loss])
        candidates = [grid[i] for i in (i_best - 1, i_best, i_best + 1) if 0 <= i < len(grid)]
        candidates = [r for r in candidates if math.isfinite(r.steps[cfg.target_loss])]
        seed_steps: dict[float, list[float]] = {}
        for r in candidates:
            seed_steps[r.lr] = [r.steps[cfg.target_loss]]
            for seed in range(1, cfg.seeds):
                rs = train_to_targets(data, cfg, b, r.lr, seed, (cfg.target_loss,), budget, every)
                seed_steps[r.lr].append(rs.steps[cfg.target_loss])
        tuned = min(seed_steps, key=lambda lr: np.mean(seed_steps[lr]))
        extra = {}
        for t in cfg.extra_targets:
            rt = min(grid, key=lambda r: r.steps[t])
            extra[t] = (rt.lr, rt.steps[t])
        res = BatchResult(b, grid, tuned, seed_steps, extra)
        results.append(res)
        if math.isfinite(res.steps):
            guess = res.steps / 1.5  # the next (doubled) batch needs fewer steps
        statuses = " ".join(f"{r.lr:g}:{_short(r)}" for r in grid)
        log(f"B={b:4d}  tuned lr {tuned:g}  S={res.steps:8.1f} ± {res.steps_sd:6.1f}  "
            f"(eval every {every}; {time.time() - t0:5.1f} s)  seed 0: {statuses}")
    return results


def _short(r: RunResult) -> str:
    return {"diverged": "div", "cut": "cut", "budget": "budget"}.get(r.status, f"{r.steps[min(r.steps)]:.0f}")


# ------------------------------------------------------------------------------------------------ fits
def fit_linear(batch: np.ndarray, steps: np.ndarray) -> dict[str, float]:
    """Least squares of S on 1/B with relative errors (weights 1/S): S = S_min + S_min·B_crit/B."""
    w = 1.0 / steps
    a = np.stack([np.ones_like(batch), 1.0 / batch], axis=1) * w[:, None]
    coef, *_ = np.linalg.lstsq(a, steps * w, rcond=None)
    s_min, slope = coef
    dof = max(len(batch) - 2, 1)
    resid = steps * w - a @ coef
    cov = np.linalg.inv(a.T @ a) * (resid @ resid) / dof
    b_crit = slope / s_min
    # Delta method for B_crit = slope/S_min.
    grad = np.array([-slope / s_min**2, 1.0 / s_min])
    se_b = float(math.sqrt(max(grad @ cov @ grad, 0.0)))
    return dict(s_min=float(s_min), b_crit=float(b_crit), e_min=float(s_min * b_crit),
                s_min_se=float(math.sqrt(cov[0, 0])), b_crit_se=se_b)


def fit_hyperbola(batch: np.ndarray, steps: np.ndarray) -> dict[str, float]:
    """Least squares in log S: log S = log S_min + log(1 + B_crit/B) (McCandlish's fit of the hyperbola)."""
    from scipy.optimize import curve_fit

    def model(b, log_s_min, log_b_crit):
        return log_s_min + np.log1p(np.exp(log_b_crit) / b)

    lin = fit_linear(batch, steps)
    p0 = [math.log(max(lin["s_min"], 1.0)), math.log(max(lin["b_crit"], 1.0))]
    (ls, lb), cov = curve_fit(model, batch, np.log(steps), p0=p0, maxfev=20000)
    s_min, b_crit = math.exp(ls), math.exp(lb)
    sd = np.sqrt(np.clip(np.diag(cov), 0, None))
    return dict(s_min=s_min, b_crit=b_crit, e_min=s_min * b_crit, s_min_se=s_min * float(sd[0]),
                b_crit_se=b_crit * float(sd[1]), log_b_crit_sd=float(sd[1]))


def seed_resample_fit(batch: np.ndarray, per_seed: list[np.ndarray], rng: np.random.Generator) -> Optional[float]:
    """``B_crit`` of the hyperbola refitted to one bootstrap resample of the seeds' steps at each batch size
    (``None`` for a degenerate resample)."""
    s = np.array([rng.choice(v, size=len(v)).mean() for v in per_seed])
    try:
        return fit_hyperbola(batch, s)["b_crit"]
    except Exception:  # a degenerate resample
        return None


def bootstrap_b_crit(results: list[BatchResult], n: int, seed: int = 0) -> dict[str, Any]:
    """Resample the seeds at each B's tuned LR (and, separately, the batch sizes); refit the hyperbola."""
    rng = np.random.default_rng(seed)
    batch = np.array([r.batch_size for r in results], dtype=float)
    per_seed = [np.array(r.seed_steps[r.tuned_lr]) for r in results]
    over_seeds, over_batches = [], []
    for _ in range(n):
        fitted = seed_resample_fit(batch, per_seed, rng)
        if fitted is not None:
            over_seeds.append(fitted)
        pick = rng.choice(len(batch), size=len(batch))
        if len(set(pick)) >= 3:
            s_mean = np.array([v.mean() for v in per_seed])
            try:
                over_batches.append(fit_hyperbola(batch[pick], s_mean[pick])["b_crit"])
            except Exception:
                pass

    def interval(v):
        v = np.array([x for x in v if math.isfinite(x)])
        return (float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))) if len(v) else (math.nan, math.nan)

    return dict(seeds=interval(over_seeds), batches=interval(over_batches), n=n)


# -------------------------------------------------------------------------------------- exact B_simple, B_noise
def exact_sums(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Exact ``(|G|², tr Σ)`` over the whole training set for the MLP, from per-example norms in closed form
    (Goodfellow 2015: ``|∇W_i|² = |a_i|²·|δ_i|²``, the bias adds ``|δ_i|²``); ~10 ms, so every step affords it."""
    lin1, act, lin2 = net[0], net[1], net[2]
    z = lin1(x)
    h = act(z)
    out = lin2(h)
    dz, dout = torch.autograd.grad(F.cross_entropy(out, y, reduction="sum"), [z, out])
    sq = ((x.pow(2).sum(1) + 1) * dz.pow(2).sum(1) + (h.pow(2).sum(1) + 1) * dout.pow(2).sum(1)).double()
    n = len(x)
    grad = torch.cat([(dz.T @ x).reshape(-1), dz.sum(0), (dout.T @ h).reshape(-1), dout.sum(0)]).double() / n
    grad_sq = grad.pow(2).sum().item()
    return grad_sq, sq.mean().item() - grad_sq


def exact_curvature(net: nn.Module, x: torch.Tensor, y: torch.Tensor, hvp_examples: int, seed: int = 0) -> dict:
    """``GᵀHG`` and ``tr(HΣ)`` with ``H`` the exact full-batch Hessian (Hessian-vector products).

    ``tr(HΣ) = mean_i (g_i − G)ᵀH(g_i − G)`` over an i.i.d. subsample of ``hvp_examples`` examples (unbiased).
    """
    from gns_callback.exact import per_example_gradients

    g = per_example_gradients(net, F.cross_entropy, x, y).float()  # (N, P)
    params = [p for p in net.parameters() if p.requires_grad]
    loss = F.cross_entropy(net(x), y)
    flat = torch.cat([gr.reshape(-1) for gr in torch.autograd.grad(loss, params, create_graph=True)])
    mean = g.mean(0)
    pick = torch.randint(0, len(x), (hvp_examples,), generator=torch.Generator().manual_seed(seed))
    quad = []
    for v in torch.cat([mean[None], g[pick] - mean]):  # a loop of HVPs is faster here than is_grads_batched
        hv = torch.autograd.grad(flat, params, grad_outputs=v, retain_graph=True)
        quad.append(torch.dot(torch.cat([h.reshape(-1) for h in hv]).double(), v.double()).item())
    return dict(ghg=quad[0], tr_h_sigma=float(np.mean(quad[1:])), loss=loss.item())


def exact_along_run(data, cfg: Config, res: BatchResult, ema_decay: float = 0.99) -> dict[str, Any]:
    """Replay seed 0 at the tuned LR: exact |G|², tr Σ at the parameters of every step (where the callback
    measures), and the Hessian terms at ``exact_checkpoints`` evenly spaced steps."""
    from gns_callback.exact import exact_b_simple

    x, y = data
    total = int(math.ceil(res.seed_steps[res.tuned_lr][0]))
    n = max(cfg.exact_checkpoints, 2)
    hessian_at = {int(round((total - 1) * k / (n - 1))) for k in range(n)}
    grad_sq, trace, checkpoints = [], [], []
    check = {}

    def measure(net: nn.Module, t: int) -> None:  # parameters after t updates = those of optimizer step t + 1
        gs, tr = exact_sums(net, x, y)
        grad_sq.append(gs)
        trace.append(tr)
        if t == 0:  # the closed form against the brute-force reference
            check["reference"] = exact_b_simple(net, F.cross_entropy, x, y)[0]
            check["closed_form"] = tr / gs
        if t in hessian_at:
            checkpoints.append(dict(step=t + 1, b_simple=tr / gs, grad_sq=gs, trace=tr,
                                    **exact_curvature(net, x, y, cfg.hvp_examples, seed=t)))

    def on_checkpoint(step: int, net: nn.Module) -> None:
        if step < total:
            measure(net, step)

    net0 = make_net(cfg.hidden)
    measure(net0, 0)
    train_to_targets(data, cfg, res.batch_size, res.tuned_lr, 0, (cfg.target_loss,), total, total,
                     checkpoint_steps=tuple(range(1, total)), on_checkpoint=on_checkpoint)
    gs, tr = np.array(grad_sq), np.array(trace)
    w = ema_decay ** np.arange(len(gs))[::-1]
    for c in checkpoints:
        c["b_noise"] = c["tr_h_sigma"] / c["ghg"] if c["ghg"] > 0 else math.nan
        c["eps_max"] = c["grad_sq"] / c["ghg"] if c["ghg"] > 0 else math.nan  # quadratic model's best step
    ghg = np.array([c["ghg"] for c in checkpoints])
    trh = np.array([c["tr_h_sigma"] for c in checkpoints])
    gsc = np.array([c["grad_sq"] for c in checkpoints])
    trc = np.array([c["trace"] for c in checkpoints])
    return dict(
        batch_size=res.batch_size,
        lr=res.tuned_lr,
        steps=total,
        per_step=(tr / gs).tolist(),
        run_ratio=float(tr.sum() / gs.sum()),  # what the callback's run average estimates
        cumulative=(np.cumsum(tr) / np.cumsum(gs)).tolist(),
        ema_final=float((w * tr).sum() / (w * gs).sum()),  # what the callback's final EMA estimates
        mean_of_ratios=float(np.mean(tr / gs)),
        median_ratio=float(np.median(tr / gs)),
        checkpoints=checkpoints,
        b_simple_at_checkpoints=float(trc.sum() / gsc.sum()),
        b_noise_run=float(trh.sum() / ghg.sum()),  # ratio of sums over the checkpoints
        b_noise_median=float(np.nanmedian([c["b_noise"] for c in checkpoints])),
        eps_max_median=float(np.nanmedian([c["eps_max"] for c in checkpoints])),
        check=check,
    )


# ------------------------------------------------------------------------------------------------ callback runs
def callback_run(data, cfg: Config, res: BatchResult, seed: int = 0) -> dict[str, Any]:
    """Lightning replay of ``seed`` at the tuned LR (same init, same batches) for the steps it took to the target."""
    from gns_callback import GradientNoiseScaleCallback
    from tests.helpers import Classifier, quiet_trainer

    x, y = data
    steps = int(math.ceil(res.seed_steps[res.tuned_lr][seed]))

    class Replay(torch.utils.data.IterableDataset):
        def __iter__(self):
            for _, idx in zip(range(steps), batch_indices(len(x), res.batch_size, seed)):
                yield x[idx], y[idx]

    loader = torch.utils.data.DataLoader(Replay(), batch_size=None)
    every = max(1, steps // 40)
    # The replayed batches are draws with replacement, which the loader can't show: say they are random draws.
    cb = GradientNoiseScaleCallback(method="per_example", verbose=False, log_every_n_steps=every,
                                    report_path=os.devnull, data_in_random_order=True)
    module = Classifier(make_net(cfg.hidden), lr=res.tuned_lr)
    trainer = quiet_trainer(max_steps=steps, max_epochs=1, callbacks=[cb], log_every_n_steps=every)
    trainer.fit(module, loader)
    history = cb.history
    early = _early(history, steps)
    ema_values = [h["b_simple"] for h in history if h.get("b_simple") is not None]
    return dict(
        batch_size=res.batch_size,
        seed=seed,
        lr=res.tuned_lr,
        steps=steps,
        final_loss=full_loss(module.net, x, y),
        run=cb.run_estimate,
        ema=cb.estimate,
        history=history,
        early=early,
        mean_of_ema=float(np.mean(ema_values)) if ema_values else math.nan,
    )


def _early(history: list[dict], steps: int) -> dict[str, float]:
    """The run average at the first logging point at or after 10% of the run."""
    for h in history:
        if h["step"] >= 0.1 * steps and h.get("b_simple_run") is not None:
            return dict(step=h["step"], b_simple=h["b_simple_run"], ci_low=h.get("run_ci_low") or math.nan,
                        ci_high=h.get("run_ci_high") or math.inf)
    return dict(step=math.nan, b_simple=math.nan, ci_low=math.nan, ci_high=math.nan)


# -------------------------------------------------------------------------------------- the recommendation, run
def run_recommendation(data, cfg: Config, rec: Any, results: list[BatchResult], log: Callable[[str], None]) -> dict:
    """Train at the recommended batch: with the recommended LR (all seeds; no divergence cut, the step budget
    only), and with the LR tuned on the grid at that batch (from the sweep, or a sweep of that one batch)."""
    b = int(rec.batch_size)
    tuned = next((r for r in results if r.batch_size == b), None)
    if tuned is None:
        tuned = sweep(data, replace(cfg, batch_sizes=(b,)), log)[0]
    guess = tuned.steps
    budget = min(cfg.max_steps, cfg.max_examples // b)
    no_cut = replace(cfg, diverge_factor=math.inf)
    runs = [train_to_targets(data, no_cut, b, rec.learning_rate, seed, (cfg.target_loss,), budget,
                             eval_every_for(cfg, guess)) for seed in range(cfg.seeds)]
    steps = [r.steps[cfg.target_loss] for r in runs]
    return dict(batch_size=b, lr=rec.learning_rate, steps=steps, statuses=[r.status for r in runs], budget=budget,
                tuned=tuned)


# ------------------------------------------------------------------------------------------------ the whole run
def run_benchmark(quick: bool = False, log: Callable[[str], None] = print, cfg: Optional[Config] = None) -> dict:
    from gns_callback.recommendation import recommend

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran in this process
        pass
    cfg = cfg or (QUICK if quick else Config())
    t_start = time.time()
    code = code_version()
    data = load_data(cfg.train_size)
    results = sweep(data, cfg, log)
    batch = np.array([r.batch_size for r in results], dtype=float)
    steps = np.array([r.steps for r in results])
    lin, hyp = fit_linear(batch, steps), fit_hyperbola(batch, steps)
    boot = bootstrap_b_crit(results, cfg.bootstrap)
    log(f"fit: hyperbola S_min={hyp['s_min']:.1f} B_crit={hyp['b_crit']:.1f}; linear S_min={lin['s_min']:.1f} "
        f"B_crit={lin['b_crit']:.1f}; bootstrap 95% {boot['seeds']}")
    by_batch = {r.batch_size: r for r in results}
    extra_fits = {}
    for t in cfg.extra_targets:
        s_t = np.array([r.extra[t][1] for r in results])
        ok = np.isfinite(s_t)
        extra_fits[t] = fit_hyperbola(batch[ok], s_t[ok]) if ok.sum() >= 3 else None

    callbacks = []
    runs = [(b, 0) for b in cfg.callback_batches] + [(cfg.primary_batch, k) for k in range(1, cfg.seeds)]
    for b, seed in runs:
        t0 = time.time()
        c = callback_run(data, cfg, by_batch[b], seed)
        c["recommendation"] = recommend(c["run"], current_batch_size=b, current_lr=c["lr"],
                                        optimizer=torch.optim.SGD, dataset_size=cfg.train_size)
        callbacks.append(c)
        log(f"callback B={b} seed {seed}: {c['steps']} steps, final loss {c['final_loss']:.4f}, "
            f"run {c['run'].b_simple:.1f} "
            f"[{c['run'].ci_low:.1f}, {c['run'].ci_high:.1f}], EMA {c['ema'].b_simple:.1f}, early "
            f"{c['early']['b_simple']:.1f}; recommend {c['recommendation'].batch_size} "
            f"({c['recommendation'].status}) ({time.time() - t0:.1f} s)")
    primary = next(c for c in callbacks if c["batch_size"] == cfg.primary_batch and c["seed"] == 0)
    t0 = time.time()
    rec_run = run_recommendation(data, cfg, primary["recommendation"], results, log)
    log(f"recommended B={rec_run['batch_size']} at lr {rec_run['lr']:g}: steps {rec_run['steps']}; at tuned lr "
        f"{rec_run['tuned'].tuned_lr:g}: {rec_run['tuned'].steps:.0f} ({time.time() - t0:.1f} s)")
    exact = {}
    for b in cfg.exact_batches:
        t0 = time.time()
        e = exact[b] = exact_along_run(data, cfg, by_batch[b])
        log(f"exact along B={b}: run ratio {e['run_ratio']:.1f}, final EMA {e['ema_final']:.1f}, mean of ratios "
            f"{e['mean_of_ratios']:.1f}, B_noise (sums) {e['b_noise_run']:.1f}"
            f"; eps_max median {e['eps_max_median']:.2f}; check {e['check']} ({time.time() - t0:.1f} s)")
    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return dict(cfg=cfg, quick=cfg == QUICK, code=code, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load=load,
                results=results, linear=lin, hyperbola=hyp, bootstrap=boot, extra_fits=extra_fits,
                callbacks=callbacks, recommendation_run=rec_run, exact=exact, seconds=time.time() - t_start)


# ------------------------------------------------------------------------------------------------ landing on the curve
def landing(out: dict, batch_size: float) -> dict[str, Any]:
    """S/S_min and E/E_min of ``batch_size`` from the fitted model and at the nearest measured batch sizes."""
    fit = out["hyperbola"]
    s_min, b_crit = fit["s_min"], fit["b_crit"]
    rows = sorted(out["results"], key=lambda r: abs(math.log(r.batch_size / batch_size)))
    nearest = sorted(rows[:2] if rows[0].batch_size != batch_size else rows[:1], key=lambda r: r.batch_size)
    return dict(
        model_s=1 + b_crit / batch_size,
        model_e=1 + batch_size / b_crit,
        measured=[dict(batch_size=r.batch_size, s=r.steps / s_min, e=r.batch_size * r.steps / (s_min * b_crit),
                       lr=r.tuned_lr) for r in nearest],
    )


# ------------------------------------------------------------------------------------------------ figure
def plot(out: dict, path: str) -> None:
    from matplotlib.figure import Figure

    fit, results = out["hyperbola"], out["results"]
    s_min, b_crit, e_min = fit["s_min"], fit["b_crit"], fit["e_min"]
    primary = next(c for c in out["callbacks"] if c["batch_size"] == out["cfg"].primary_batch)
    rec = primary["recommendation"]
    run = primary["run"]

    fig = Figure(figsize=(12, 5.6), layout="constrained")
    ax, bx = fig.subplots(1, 2, gridspec_kw=dict(width_ratios=[1.1, 1]))

    def point(b):
        return e_min * (1 + b / b_crit), s_min * (1 + b_crit / b)

    b_lo, b_hi = min(r.batch_size for r in results), max(r.batch_size for r in results)
    bs = np.logspace(math.log10(b_lo / 1.5), math.log10(b_hi * 3), 300)
    ex, sx = point(bs)
    ax.plot(ex, sx, color="black", lw=1.2, label=f"fit S = S_min(1 + B_crit/B), B_crit = {b_crit:.0f}")
    ax.axhline(s_min, color="grey", ls=":", lw=1)
    ax.axvline(e_min, color="grey", ls=":", lw=1)
    ax.text(ex[-1], s_min * 1.03, "S_min", ha="right", va="bottom", fontsize=8, color="grey")
    ax.text(e_min * 1.03, sx[0], "E_min", ha="left", va="top", fontsize=8, color="grey")
    # B_simple (run average) interval as a band along the curve, and its point.
    lo, hi = run.ci_low, run.ci_high if math.isfinite(run.ci_high) else bs[-1]
    seg = np.logspace(math.log10(max(lo, bs[0])), math.log10(min(hi, bs[-1])), 100)
    ax.plot(*point(seg), color="#1f77b4", lw=9, alpha=0.25, solid_capstyle="round",
            label=f"B in B_simple's 95% CI [{run.ci_low:.0f}, {run.ci_high:.0f}] "
                  f"(run avg, B={primary['batch_size']} run)")
    ax.plot(*point(run.b_simple), marker="o", ms=6, color="#1f77b4", mec="black", ls="none", zorder=7,
            label=f"B = B_simple run average = {run.b_simple:.0f}")
    ax.plot(*point(primary["ema"].b_simple), marker="s", ms=7, color="#9467bd", mec="black", ls="none",
            label=f"B = final EMA B_simple = {primary['ema'].b_simple:.0f}")
    ax.plot(*point(b_crit), marker="o", ms=8, mfc="white", mec="black", ls="none",
            label="knee B = B_crit (S=2S_min, E=2E_min)")
    ax.plot(*point(rec.batch_size), marker="*", ms=22, color="#2ca02c", mec="black", ls="none", zorder=3,
            label=f"recommended B = {rec.batch_size} ({rec.status})")
    rr = out.get("recommendation_run")
    if rr:
        finite = [v for v in rr["steps"] if math.isfinite(v)]
        if finite:
            s_rec = float(np.mean(finite))
            ax.plot([rr["batch_size"] * s_rec], [s_rec], marker="*", ms=15, mfc="white", mec="#2ca02c", mew=2,
                    ls="none", label=f"measured: B = {rr['batch_size']} at the recommended LR {rr['lr']:.3g}")
    e_meas = np.array([r.batch_size * r.steps for r in results])
    s_meas = np.array([r.steps for r in results])
    s_err = np.array([r.steps_sd for r in results])
    ax.errorbar(e_meas, s_meas, yerr=s_err, fmt="D", color="#d62728", mec="black", ms=6, capsize=2,
                label="measured (mean ± sd over seeds)", zorder=5)
    for r, e, s in zip(results, e_meas, s_meas):
        right = r.batch_size < b_crit / 2  # left of the knee the curve runs left of the points
        ax.annotate(f"B={r.batch_size}", (e, s), textcoords="offset points", xytext=(8, 0) if right else (-8, -4),
                    fontsize=8, ha="left" if right else "right", va="center" if right else "top", zorder=10)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("E = B·S  (examples processed to reach the target)")
    ax.set_ylabel("S  (optimizer steps to reach the target)")
    ax.set_title(f"Digits MLP, plain SGD, LR tuned per B: steps vs examples to train loss {out['cfg'].target_loss:g}",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2, frameon=False)

    # Right: noise scale along the primary run (seed 0), callback against the exact values on the same trajectory.
    hist = primary["history"]
    st = [h["step"] for h in hist]

    def col(name):
        return [h[name] if h.get(name) is not None else math.nan for h in hist]

    ex = out["exact"].get(primary["batch_size"])
    if ex:
        steps = np.arange(1, len(ex["per_step"]) + 1)
        bx.plot(steps, ex["per_step"], color="0.6", lw=0.6, label="exact B_simple at each step")
        bx.plot(steps, ex["cumulative"], color="black", lw=1.5, ls="--",
                label="exact run average (ratio of cumulative sums)")
    bx.fill_between(st, col("run_ci_low"), col("run_ci_high"), color="#1f77b4", alpha=0.18, lw=0)
    bx.plot(st, col("b_simple_run"), color="#1f77b4", lw=2.2, label="callback run average (95% CI band)")
    bx.plot(st, col("b_simple"), color="#9467bd", lw=1.5, label="callback EMA (decay 0.99)")
    if ex:
        bx.plot([c["step"] for c in ex["checkpoints"]], [c["b_noise"] for c in ex["checkpoints"]], "v", color="#ff7f0e",
                mec="black", ms=6, ls="none", label="exact B_noise = tr(HΣ)/GᵀHG")
    lo_b, hi_b = out["bootstrap"]["seeds"]
    bx.axhspan(lo_b, hi_b, color="#d62728", alpha=0.15, lw=0)
    bx.axhline(b_crit, color="#d62728", lw=1.8, label=f"measured B_crit = {b_crit:.0f} (95% bootstrap band)")
    bx.set_yscale("log")
    bx.set_xlabel(f"optimizer step (B = {primary['batch_size']}, lr = {primary['lr']:g}, seed 0; ends at the target)")
    bx.set_ylabel("noise scale (examples)")
    bx.set_title("Noise scale along that run vs the measured critical batch", fontsize=10)
    bx.grid(True, which="both", alpha=0.25)
    top = max([v for v in (ex["per_step"] if ex else []) + col("b_simple") if math.isfinite(v)] + [b_crit])
    bx.set_ylim(None, top * 1.5)
    bx.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2, frameon=False)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)


# ------------------------------------------------------------------------------------------------ markdown
def _ci(lo: float, hi: float) -> str:
    return f"{lo:.0f} – {hi:.0f}" if math.isfinite(hi) else f"{lo:.0f} – ∞"


def comparison(out: dict) -> dict[str, Any]:
    """How far each callback value is from the measured B_crit (factor = value/B_crit), over the seed-0 runs."""
    b_crit = out["hyperbola"]["b_crit"]
    rows = [c for c in out["callbacks"] if c["seed"] == 0]
    values = {
        "run average": [c["run"].b_simple for c in rows],
        "final EMA": [c["ema"].b_simple for c in rows],
        "early (10% of the run)": [c["early"]["b_simple"] for c in rows],
        "mean of EMA values": [c["mean_of_ema"] for c in rows],
    }
    summary = {}
    for name, v in values.items():
        f = np.array([x / b_crit for x in v if math.isfinite(x) and x > 0])
        summary[name] = dict(median=float(np.median(f)), lo=float(f.min()), hi=float(f.max()),
                             log_error=float(np.median(np.abs(np.log(f)))))
    best = min(summary, key=lambda k: summary[k]["log_error"])
    covered = sum(c["run"].ci_low <= b_crit <= c["run"].ci_high for c in rows)
    return dict(summary=summary, best=best, covered=covered, runs=len(rows))


def render(out: dict, command: str, figure_link: Optional[str] = "figures/critical_batch_digits.png") -> str:
    import pytorch_lightning as pl

    cfg, fit, lin, boot = out["cfg"], out["hyperbola"], out["linear"], out["bootstrap"]
    s_min, b_crit, e_min = fit["s_min"], fit["b_crit"], fit["e_min"]
    load = out.get("load", (math.nan,) * 3)
    lines = [
        f"- Command: `{command}` — {out.get('date', '?')}; {platform.machine()}, "
        f"{os.cpu_count()} CPU cores shared with other work (load average {load[0]:.1f} at the end), no GPU; torch "
        f"{torch.__version__} (1 thread), pytorch-lightning {pl.__version__}, Python {platform.python_version()}; "
        f"total {out['seconds']:.0f} s. gns_callback: {out.get('code', 'unknown')}.",
        f"- Setup: scikit-learn digits, {cfg.train_size} training examples (pixels/16), MLP 64-{cfg.hidden}-10 (tanh), "
        "one fixed initialisation; **plain SGD (no momentum, no weight decay), constant LR**; batches i.i.d. with "
        "replacement. S = optimizer steps until the *full training-set* cross-entropy first reaches "
        f"**{cfg.target_loss:g}** (evaluated every ≈S/{cfg.evals_per_run} steps, crossing interpolated in log-loss). "
        f"LR grid {', '.join(f'{v:g}' for v in cfg.lrs)} (factor √2). Seed 0 runs the whole grid (a run "
        f"{cfg.prune_factor:g}× slower than the best so far is cut; loss above {cfg.diverge_factor:g}× the initial "
        f"loss = diverged); the best LR and its two grid neighbours then run {cfg.seeds} data-order seeds in all; "
        "tuned LR = fewest mean steps. E = B·S.",
        "",
        "| B | tuned LR | S (mean ± sd, seeds) | E = B·S | S/S_min | E/E_min |",
        "|---|---|---|---|---|---|",
    ]
    for r in out["results"]:
        e = r.batch_size * r.steps
        lines.append(f"| {r.batch_size} | {r.tuned_lr:g} | {r.steps:.0f} ± {r.steps_sd:.0f} | {e:,.0f} | "
                     f"{r.steps / s_min:.2f} | {e / e_min:.2f} |")
    lines += [
        "",
        f"**Fit** of S = S_min(1 + B_crit/B) (least squares in log S): S_min = {s_min:.0f} ± {fit['s_min_se']:.0f}, "
        f"E_min = {e_min:,.0f}, **B_crit = E_min/S_min = {b_crit:.1f}** (fit s.e. ± {fit['b_crit_se']:.1f}; 95% "
        f"bootstrap over seeds {boot['seeds'][0]:.1f} – {boot['seeds'][1]:.1f}, over batch sizes "
        f"{boot['batches'][0]:.1f} – {boot['batches'][1]:.1f}; {boot['n']} resamples). Linear regression of S on 1/B "
        f"(relative errors): S_min = {lin['s_min']:.0f}, B_crit = slope/intercept = {lin['b_crit']:.1f} ± "
        f"{lin['b_crit_se']:.1f}. S/S_min and E/E_min above use the first fit.",
    ]
    extra = sorted(((t, f) for t, f in out["extra_fits"].items() if f is not None), reverse=True)
    if extra:
        parts = [f"{t:g} → {f['b_crit']:.1f}" for t, f in extra]
        lines.append("- B_crit at shallower targets (seed 0 only, LR re-tuned per target from the same runs): "
                     + ", ".join(parts) + f" (and {cfg.target_loss:g} → {b_crit:.1f} with all seeds).")
    lines += [
        "",
        "**The callback**, `GradientNoiseScaleCallback(method=\"per_example\")` (defaults otherwise: EMA decay 0.99, "
        "16 measured examples per batch), in Lightning runs that replay a sweep run at its tuned LR — same init, "
        "same batches — for the steps that run took to the target (the final loss confirms the replay). Intervals "
        "95%. *early* = the run average at the first logging point past 10% of the run; *mean of EMA* = mean of the "
        "≈40 logged EMA values (a mean of per-window ratios, the alternative to the ratio of cumulative sums). "
        f"×B_crit = value/{b_crit:.1f}. *recommend()* = `recommend(cb.run_estimate, current_batch_size=B, "
        "current_lr=lr, optimizer=torch.optim.SGD, dataset_size=1500)`; S/S_min, E/E_min at its batch from the fit.",
        "",
        "| run B | seed | lr | steps | final loss | run average (CI) | ×B_crit | final EMA (CI) | ×B_crit | early | ×B_crit "
        "| mean of EMA | ×B_crit | recommend() → B | S/S_min | E/E_min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in out["callbacks"]:
        run, ema, early, rec = c["run"], c["ema"], c["early"], c["recommendation"]
        lines.append(
            f"| {c['batch_size']} | {c['seed']} | {c['lr']:g} | {c['steps']} | {c['final_loss']:.4f} | "
            f"{run.b_simple:.0f} ({_ci(run.ci_low, run.ci_high)}) | {run.b_simple / b_crit:.2f} | {ema.b_simple:.0f} "
            f"({_ci(ema.ci_low, ema.ci_high)}) | {ema.b_simple / b_crit:.2f} | {early['b_simple']:.0f} | "
            f"{early['b_simple'] / b_crit:.2f} | {c['mean_of_ema']:.0f} | {c['mean_of_ema'] / b_crit:.2f} | "
            f"{rec.batch_size} ({rec.status}) | {1 + b_crit / rec.batch_size:.2f} | {1 + rec.batch_size / b_crit:.2f} |"
        )
    cmp_ = comparison(out)
    summ = cmp_["summary"]
    lines += [
        "",
        "Against B_crit over the seed-0 runs (factor value/B_crit, median and range): "
        + "; ".join(f"{k} {v['median']:.2f}× ({v['lo']:.2f}–{v['hi']:.2f})" for k, v in summ.items())
        + f". Closest (median |log factor|): **{cmp_['best']}**. B_crit lies inside the run average's interval in "
        f"{cmp_['covered']} of {cmp_['runs']} runs.",
    ]
    if out["exact"]:
        lines += [
            "",
            "**Exact values on the same trajectories** (seed 0 replayed in a plain loop): |G|² and tr Σ over all "
            f"{cfg.train_size} examples at the parameters of every step (closed-form per-example norms, checked "
            "against `gns_callback.exact` at step 1); B_noise = tr(HΣ)/(GᵀHG) with the exact full-batch Hessian "
            f"(Hessian-vector products; tr(HΣ) over {cfg.hvp_examples} sampled examples) at {cfg.exact_checkpoints} "
            "evenly spaced steps; ε_max = |G|²/GᵀHG is the quadratic model's best step.",
            "",
            "| run B | lr | exact run average (Σ tr Σ / Σ ‖G‖²) | callback run average | exact final EMA | callback "
            "final EMA | mean of per-step ratios | median per-step | B_noise (Σ over checkpoints) | B_noise median "
            "| ε_max median |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for b, e in out["exact"].items():
            c = next(c for c in out["callbacks"] if c["batch_size"] == b and c["seed"] == 0)
            lines.append(
                f"| {b} | {e['lr']:g} | {e['run_ratio']:.0f} | {c['run'].b_simple:.0f} "
                f"({_ci(c['run'].ci_low, c['run'].ci_high)}) | {e['ema_final']:.0f} | {c['ema'].b_simple:.0f} | "
                f"{e['mean_of_ratios']:.0f} | {e['median_ratio']:.0f} | {e['b_noise_run']:.0f} | "
                f"{e['b_noise_median']:.0f} | {e['eps_max_median']:.2f} |"
            )
    primary = next(c for c in out["callbacks"] if c["batch_size"] == cfg.primary_batch and c["seed"] == 0)
    rec = primary["recommendation"]
    land = landing(out, rec.batch_size)
    meas = "; ".join(f"B={m['batch_size']} (tuned LR {m['lr']:g}): S/S_min = {m['s']:.2f}, E/E_min = {m['e']:.2f}"
                     for m in land["measured"])
    lines += [
        "",
        f"**Recommendation** from the B={cfg.primary_batch} run (seed 0): `recommend(cb.run_estimate, "
        f"current_batch_size={cfg.primary_batch}, current_lr={primary['lr']:g}, optimizer=torch.optim.SGD, "
        f"dataset_size={cfg.train_size})` → status `{rec.status}`, batch **{rec.batch_size}**, LR "
        f"{rec.learning_rate:.3g} ({rec.lr_rule} rule), warmup {rec.warmup_steps} steps. On the fitted curve: "
        f"S/S_min = {land['model_s']:.2f}, E/E_min = {land['model_e']:.2f} (the knee is 2, 2). Measured nearest: "
        f"{meas}.",
    ]
    rr = out.get("recommendation_run")
    if rr:
        b_rec, tuned = rr["batch_size"], rr["tuned"]
        finite = [v for v in rr["steps"] if math.isfinite(v)]
        at_rec = (f"S = {np.mean(finite):.0f} (seeds: {', '.join(f'{v:.0f}' for v in rr['steps'])}), S/S_min = "
                  f"{np.mean(finite) / s_min:.2f}, E/E_min = {b_rec * np.mean(finite) / e_min:.2f}"
                  if len(finite) == len(rr["steps"]) else
                  f"{len(rr['steps']) - len(finite)} of {len(rr['steps'])} seeds did not reach the target within "
                  f"{rr['budget']} steps (steps: {', '.join(f'{v:.0f}' for v in rr['steps'])})")
        lines.append(
            f"- Measured at the recommended batch {b_rec}, {cfg.seeds} seeds: with the recommended LR "
            f"{rr['lr']:.3g} (no divergence cut here, step budget only): {at_rec}. With the LR tuned on the grid at "
            f"B={b_rec} ({tuned.tuned_lr:g}): S = {tuned.steps:.0f} ± {tuned.steps_sd:.0f}, S/S_min = "
            f"{tuned.steps / s_min:.2f}, E/E_min = {b_rec * tuned.steps / e_min:.2f}."
        )
    if not out.get("quick"):
        lines += ["", interpretation(out)]
    if figure_link:
        lines += ["", f"![steps vs examples and the noise scale along the run, digits]({figure_link})"]
    return "\n".join(lines)


def code_version() -> str:
    """The commit of the working tree and whether gns_callback/ has uncommitted changes (read-only git)."""
    import subprocess

    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "gns_callback"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no git)"
    return f"commit {head}" + (" + uncommitted changes to gns_callback/" if dirty else "")


def _at_fraction(values: list[float], fraction: float) -> float:
    return values[max(0, int(len(values) * fraction) - 1)]


def interpretation(out: dict) -> str:
    """The reading of the full run. The numbers are computed; the wording was written after reading the recorded
    run (2026-11-21) and checks the directions it asserts, so a rerun that changes them says so."""
    cfg, fit = out["cfg"], out["hyperbola"]
    b_crit, s_min = fit["b_crit"], fit["s_min"]
    cmp_ = comparison(out)
    sm = cmp_["summary"]
    seed0 = [c for c in out["callbacks"] if c["seed"] == 0]
    primary_seeds = [c for c in out["callbacks"] if c["batch_size"] == cfg.primary_batch]
    pf = [c["run"].b_simple / b_crit for c in primary_seeds]
    lo_run = min(seed0, key=lambda c: c["run"].b_simple)
    hi_run = max(seed0, key=lambda c: c["run"].b_simple)
    paras = ["**Reading** (interpretation; the numbers are from the tables above)."]

    ex = out["exact"]
    if ex:
        parts, inside, ema_dev = [], 0, 0.0
        for b, e in ex.items():
            c = next(c for c in seed0 if c["batch_size"] == b)
            ema_dev = max(ema_dev, 100 * abs(c["ema"].b_simple / e["ema_final"] - 1))
            parts.append(f"B={b}: {c['run'].b_simple:.0f} vs {e['run_ratio']:.0f}")
            inside += c["run"].ci_low <= e["run_ratio"] <= c["run"].ci_high
        paras.append(
            "1. *The callback measures what it claims.* On the replayed trajectories its run average matches the "
            f"exact ratio of cumulative sums ({'; '.join(parts)}; exact value inside the interval in {inside} of "
            f"{len(ex)}), and its final EMA is within {ema_dev:.0f}% of the exact EMA. The gaps below are between "
            "the noise scale and the critical batch, not estimator error."
        )
    better = "ratio of cumulative sums" if sm["run average"]["log_error"] <= sm["mean of EMA values"]["log_error"] \
        else "mean of per-window ratios"
    paras.append(
        f"2. *Run average vs B_crit = {b_crit:.0f}:* {sm['run average']['median']:.2f}× in the median of the "
        f"{cmp_['runs']} seed-0 runs, from {lo_run['run'].b_simple:.0f} (B={lo_run['batch_size']} run) to "
        f"{hi_run['run'].b_simple:.0f} (B={hi_run['batch_size']} run); {min(pf):.2f}–{max(pf):.2f}× over the "
        f"{len(pf)} seeds at B={cfg.primary_batch}. B_crit is inside the run average's interval in "
        f"{cmp_['covered']} of {cmp_['runs']} runs, so the interval (estimator noise only) does not cover the "
        "run-to-run spread: the noise scale depends on the trajectory (batch and LR of the run that measures it)"
        + (f", and the exact values show it too (exact run average {ex[max(ex)]['run_ratio']:.0f} along B={max(ex)} "
           f"vs {ex[min(ex)]['run_ratio']:.0f} along B={min(ex)})" if len(ex) >= 2 else "")
        + ". McCandlish's model has one B_noise per loss level and no such dependence. "
        f"*Final EMA:* {sm['final EMA']['median']:.1f}× ({sm['final EMA']['lo']:.1f}–{sm['final EMA']['hi']:.1f}×): "
        "as the design notes warn, the late local value is far above the run's critical batch — not for a fixed "
        f"batch. *Mean of EMA values* {sm['mean of EMA values']['median']:.1f}× vs run average "
        f"{sm['run average']['median']:.1f}×: of the two ways to average along the run, the **{better}** is "
        "closer here. "
        f"*Early value* (run average at 10% of the run): {sm['early (10% of the run)']['median']:.2f}× "
        f"({sm['early (10% of the run)']['lo']:.2f}–{sm['early (10% of the run)']['hi']:.2f}×)"
        + (", numerically the closest" if cmp_["best"] == "early (10% of the run)" else "")
        + f"; but the point where it is read is arbitrary and it moves by "
        f"{sm['early (10% of the run)']['hi'] / sm['early (10% of the run)']['lo']:.1f}× between runs, so I would "
        "not base the recommendation on it from one data set."
    )
    extra = sorted(((t, f["b_crit"]) for t, f in out["extra_fits"].items() if f is not None), reverse=True)
    resid = {r.batch_size: r.steps / (s_min * (1 + b_crit / r.batch_size)) for r in out["results"]}
    if ex:
        e_small = ex[min(ex)]
        v = np.array(e_small["per_step"])
        jumps = np.exp(np.abs(np.diff(np.log(v))))
        jump90, jump_max = float(np.percentile(jumps, 90)), float(jumps.max())
        max_lr = max(cfg.lrs)
        n_div = sum(any(r.lr == max_lr and r.status == "diverged" for r in br.grid) for br in out["results"])
        top_lr = max(r.tuned_lr for r in out["results"])
        lr_flat_from = min(r.batch_size for r in out["results"] if r.tuned_lr == top_lr)
        step_cost = []
        for br in out["results"]:
            fin = sorted(r.steps[cfg.target_loss] for r in br.grid if math.isfinite(r.steps[cfg.target_loss]))
            if len(fin) >= 2:
                step_cost.append(100 * (fin[1] / fin[0] - 1))
        step_cost = step_cost or [math.nan]
        crits = [v for _, v in extra] + [b_crit]
        moves = "hardly moves" if max(crits) / min(crits) < 1.6 else "changes"
        per_step_max = max(max(e["per_step"]) for e in ex.values())
        bn = "; ".join(f"B={b}: B_noise {e['b_noise_run']:.0f} ({e['b_noise_run'] / b_crit:.1f}× B_crit) vs B_simple "
                       f"{e['b_simple_at_checkpoints']:.0f} ({e['b_simple_at_checkpoints'] / b_crit:.1f}×)"
                       for b, e in ex.items())
        closed = [1 - abs(math.log(e["b_noise_run"] / b_crit)) / abs(math.log(e["b_simple_at_checkpoints"] / b_crit))
                  for e in ex.values()]
        paras.append(
            "3. *Why the noise scale and the critical batch differ (my reading).* "
            f"(a) B_simple vs B_noise, as ratios of sums over the same {cfg.exact_checkpoints} checkpoints: {bn}. "
            "The Hessian weighting removes "
            + ", ".join(f"{100 * c:.0f}% (B={b})" for c, b in zip(closed, ex))
            + " of the (log) gap: the Hessian is far from ∝ identity and explains part of the "
            "gap, not all of it. These checkpoint averages are rough: on B="
            f"{min(ex)} neighbouring steps' exact values differ by more than {jump90:.1f}× one time in ten (up to "
            f"{jump_max:.0f}×; largest value {per_step_max:.0f}; median per step {e_small['median_ratio']:.0f} vs "
            f"ratio of sums {e_small['run_ratio']:.0f}). "
            f"(b) The runs sit at the curvature limit: ε_max = |G|²/GᵀHG along the runs has median "
            + ", ".join(f"{e['eps_max_median']:.2f} at lr {e['lr']:g}" for e in ex.values())
            + f"; LR {max(cfg.lrs):g} diverged at {n_div} of {len(out['results'])} batch sizes and the tuned LR "
            f"stops growing at B={lr_flat_from} (there it is set by curvature, not by noise). A Rayleigh quotient "
            "GᵀHG/|G|² ≈ 1/lr (half "
            "the stability threshold 2/lr) means G weighs heavily on high-curvature directions, where the iterates "
            "oscillate; |G|² then swings from step to step and "
            "tr Σ/|G|² with it, and I suspect its late, large values overstate how much the noise limits progress. "
            + (f"(c) Consistent with that, B_crit {moves} with the target ("
               + ", ".join(f"loss {t:g} → {v:.0f}" for t, v in extra) + ", "
               f"{cfg.target_loss:g} → {b_crit:.0f}) while the exact B_simple grows along the runs ("
               + "; ".join(f"B={b}: run average over the first 10% {_at_fraction(e['cumulative'], 0.1):.0f} "
                           f"→ final EMA {e['ema_final']:.0f}" for b, e in ex.items())
               + "). " if extra else "")
            + f"(d) LR granularity: the second-best grid LR needs {min(step_cost):.0f}–{max(step_cost):.0f}% more "
            "steps than the best one (seed 0, over the batch sizes); an optimum between grid points could save part of "
            "that, and this error is not in the seed bootstrap. (e) The hyperbola is only an approximation: measured/"
            f"fitted S runs from {min(resid.values()):.2f} (B={min(resid, key=resid.get)}) to "
            f"{max(resid.values()):.2f} (B={max(resid, key=resid.get)}) — hence the wider bootstrap over batch sizes."
        )
    rr = out.get("recommendation_run")
    primary = next(c for c in seed0 if c["batch_size"] == cfg.primary_batch)
    rec = primary["recommendation"]
    recs = [c["recommendation"].batch_size for c in out["callbacks"]]
    sf = [1 + b_crit / b for b in recs]
    ef = [1 + b / b_crit for b in recs]
    text = (
        f"4. *Where the recommendation lands.* From the B={cfg.primary_batch} run: B={rec.batch_size}, "
        f"S/S_min = {1 + b_crit / rec.batch_size:.2f}, E/E_min = {1 + rec.batch_size / b_crit:.2f} on the fitted "
        "curve: past the knee on the large-batch side (fewer steps than at the knee, more examples). Over all "
        f"{len(recs)} callback runs the recommendations span {min(recs)}–{max(recs)}: S/S_min "
        f"{min(sf):.2f}–{max(sf):.2f}, E/E_min {min(ef):.2f}–{max(ef):.2f}."
    )
    if rr and rec.learning_rate is not None:
        finite = [v for v in rr["steps"] if math.isfinite(v)]
        tuned = rr["tuned"]
        b_n = primary["run"].b_simple
        eps_ratio = (1 + b_n / cfg.primary_batch) / (1 + b_n / rec.batch_size)
        measured = (f"S = {np.mean(finite):.0f}, {np.mean(finite) / tuned.steps:.1f}× the {tuned.steps:.0f} steps "
                    f"at the grid-tuned LR {tuned.tuned_lr:g}" if len(finite) == len(rr["steps"]) else
                    f"{len(rr['steps']) - len(finite)} of {len(rr['steps'])} seeds did not reach the target")
        text += (
            f" The batch is reasonable ({rec.batch_size / b_crit:.1f}× B_crit); **the LR is not**: the linear rule gives {rec.learning_rate:.3g} at "
            f"B={rec.batch_size} (no warmup, the factor is {rec.learning_rate / primary['lr']:.3g}), and measured "
            f"there it gives {measured}. Linear scaling holds for B ≪ B_noise; near the knee McCandlish's "
            f"ε_opt(B) ∝ 1/(1 + B_noise/B) would scale the LR by {eps_ratio:.2f} (to "
            f"{primary['lr'] * eps_ratio:.3g}, with B_noise = the run average {b_n:.0f}), close to the tuned "
            f"{tuned.tuned_lr:g}."
        )
    paras.append(text)
    return "\n\n".join(paras)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 batch sizes, 2 LRs, tiny budget (< 30 s)")
    parser.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    parser.add_argument("--figure", default=None, help=f"PNG path (default {FIGURE} with --out, none otherwise)")
    parser.add_argument("--save", default=None, help="pickle the raw results here (to re-render with --load)")
    parser.add_argument("--load", default=None, help="re-render from a --save pickle instead of running")
    args = parser.parse_args()
    if args.load:
        import pickle

        with open(args.load, "rb") as f:
            out = pickle.load(f)
    else:
        out = run_benchmark(quick=args.quick)
    if args.save:
        import pickle

        with open(args.save, "wb") as f:
            pickle.dump(out, f)
    command = "python benchmarks/critical_batch_digits.py" + (" --quick" if args.quick else "") + (
        f" --out {args.out}" if args.out else "")
    figure = args.figure or (os.path.join(ROOT, FIGURE) if args.out else None)
    if figure:
        plot(out, figure)
    link = os.path.relpath(figure, os.path.dirname(os.path.abspath(args.out))) if (figure and args.out) else None
    section = render(out, command, link)
    print(section)
    if args.out:
        from benchmarks.results import replace_section

        replace_section(args.out, SECTION_HEADING, section)


if __name__ == "__main__":
    main()
