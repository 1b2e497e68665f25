"""Learning-rate transfer across batch sizes, measured: which rule lands near the LR tuned at the new batch?

Issue 12's setup: scikit-learn's digits (all 1797 examples, pixels/16), MLP 64-64-10 with tanh, one fixed
initialisation, batches drawn i.i.d. with replacement, constant LR; the cost of a run is the number of optimizer
steps until the full-data cross-entropy first reaches the target (0.05), median over 3 data-order seeds.

1. Tune: for each batch size, an LR grid (factor 2^(1/4)); the tuned LR has the fewest median steps.
2. Measure, along the tuned run at each batch size (seed 0): the exact run-average ``B_simple`` (ratio of the
   cumulative sums of the exact ``tr Σ`` and ``|G|²`` over all 1797 per-example gradients at evenly spaced
   checkpoints: what the callback's run average estimates) and the sharpness ``λ_max`` of the full-data loss
   (``gns_callback.curvature.sharpness``) at the same checkpoints.
3. Transfer: from each tuned (B0, lr0) to every other B1, with the recommendation's own LR policy
   (``gns_callback.recommendation.learning_rate.choose_lr``; B_noise = the run-average ``B_simple`` measured at B0,
   what the recommendation gets): the explicit rules ``linear``/``sqrt`` and ``noise_linear``/``noise_sqrt``, and
   the family default, which for SGD holds the LR on an increase unless a sharpness is given, then caps it at
   the stability limit ``2/λ_max`` (λ_max at init, at the end, or the largest along the run). Each transferred LR
   is run at B1 with the recommendation's warmup when the LR rises; the result is its median steps over the
   tuned LR's median steps at B1 (1.0 = as good as tuning; ∞ = diverged or not reached in the budget).

    python benchmarks/lr_transfer_digits.py [--out benchmarks/RESULTS.md]   # ~5-10 min on 2 CPU cores
    python benchmarks/lr_transfer_digits.py --quick                        # smoke run, < 1 min

All models of one batch size train at once as a stack (``torch.bmm``), each with its own LR, warmup and seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback.curvature import sharpness  # noqa: E402
from gns_callback.recommendation.learning_rate import choose_lr  # noqa: E402
from gns_callback.recommendation.rules import warmup_epochs_for  # noqa: E402

SECTION_HEADING = "## Learning-rate transfer on digits (issue 12)"


@dataclass(frozen=True)
class Config:
    sgd_batches: tuple[int, ...] = (8, 16, 32, 64, 128, 512)
    adam_batches: tuple[int, ...] = (8, 32, 64, 128)
    sgd_lrs: tuple[float, ...] = tuple(round(0.125 * 2 ** (k / 4), 4) for k in range(18))  # 0.125 … 2.38
    adam_lrs: tuple[float, ...] = tuple(round(0.002 * 2 ** (k / 4), 5) for k in range(24))  # 0.002 … 0.11
    seeds: int = 3
    target: float = 0.05
    hidden: int = 64
    max_examples: int = 400_000  # step budget per run: max_examples / B, capped by max_steps
    max_steps: int = 8_000
    evals: int = 200  # evaluations of the full-data loss per budget
    checkpoints: int = 12  # along each tuned run, for the run-average B_simple and λ_max
    diverge_loss: float = 10.0  # a loss above this (or not finite) counts as diverged


QUICK = Config(
    sgd_batches=(8, 64), adam_batches=(8, 64), sgd_lrs=(0.25, 0.5, 1.0), adam_lrs=(0.005, 0.01, 0.02), seeds=2,
    target=0.3, max_examples=40_000, max_steps=2000, evals=50, checkpoints=3,
)


# ------------------------------------------------------------------------------------------------ data, models
def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def init_params(hidden: int, seed: int = 0) -> list[torch.Tensor]:
    """``nn.Linear``'s default initialisation of 64-hidden-10, one fixed draw."""
    torch.manual_seed(seed)
    first, second = torch.nn.Linear(64, hidden), torch.nn.Linear(hidden, 10)
    return [first.weight.T.detach(), first.bias.detach(), second.weight.T.detach(), second.bias.detach()]


def stacked(params: list[torch.Tensor], k: int) -> list[torch.Tensor]:
    return [p.unsqueeze(0).repeat(k, *([1] * p.dim())).clone().requires_grad_(True) for p in params]


def forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits ``(K, N, 10)`` of K stacked MLPs on inputs ``(K, N, 64)``."""
    w1, b1, w2, b2 = params
    h = torch.tanh(torch.baddbmm(b1.unsqueeze(1), x, w1))
    return torch.baddbmm(b2.unsqueeze(1), h, w2)


def full_losses(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Full-data cross-entropy of each of the K models."""
    with torch.no_grad():
        logits = forward(params, x.expand(params[0].shape[0], *x.shape))
        return F.cross_entropy(logits.transpose(1, 2), y.expand(params[0].shape[0], -1), reduction="none").mean(1)


# ------------------------------------------------------------------------------------------------ training
@dataclass(frozen=True)
class RunSpec:
    """One model of a stack: ``lr`` after a linear warmup from ``start_lr`` over ``warmup_steps``."""

    lr: float
    seed: int
    start_lr: Optional[float] = None
    warmup_steps: int = 0


@dataclass
class StackResult:
    steps: list[float]  # steps to the target per model (inf: not reached in the budget or diverged)
    diverged: list[bool]
    params_at: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # checkpoints, stacked (K, ...)


def crossing(s0: int, l0: float, s1: int, l1: float, target: float) -> float:
    """Step where the loss crosses ``target`` between two evaluations (linear in log-loss)."""
    if l1 >= l0 or s1 == s0:
        return float(s1)
    frac = (math.log(l0) - math.log(target)) / (math.log(l0) - math.log(l1))
    return s0 + min(max(frac, 0.0), 1.0) * (s1 - s0)


def lr_schedule(specs: list[RunSpec]) -> Callable[[int], torch.Tensor]:
    """``step ↦ (K, 1, 1)`` LRs: linear warmup from ``start_lr`` to ``lr`` (Goyal et al.), then flat."""
    target = torch.tensor([s.lr for s in specs])
    start = torch.tensor([s.lr if s.start_lr is None else s.start_lr for s in specs])
    length = torch.tensor([float(max(s.warmup_steps, 0)) for s in specs])

    def at(step: int) -> torch.Tensor:
        frac = torch.where(length > 0, torch.clamp(step / length.clamp(min=1.0), max=1.0), torch.ones_like(length))
        return (start + (target - start) * frac).view(-1, 1, 1)

    return at


def train_stack(
    data: tuple[torch.Tensor, torch.Tensor],
    cfg: Config,
    batch_size: int,
    specs: list[RunSpec],
    optimizer: str = "sgd",
    checkpoint_steps: tuple[int, ...] = (),
) -> StackResult:
    """Train K models (one per spec) from the same initialisation until each reaches the target or diverges."""
    x, y = data
    k = len(specs)
    params = stacked(init_params(cfg.hidden), k)
    lr_at = lr_schedule(specs)
    adam = [torch.zeros_like(p) for p in params for _ in (0, 1)] if optimizer == "adam" else None
    gens = [torch.Generator().manual_seed(10_000 + s.seed) for s in specs]
    budget = min(cfg.max_steps, cfg.max_examples // batch_size)
    every = max(1, budget // cfg.evals)
    prev = full_losses(params, x, y).tolist()
    steps, diverged = [math.inf] * k, [False] * k
    active = torch.ones(k, dtype=torch.bool)
    out = StackResult(steps, diverged)
    for step in range(1, budget + 1):
        idx = torch.stack([torch.randint(0, len(x), (batch_size,), generator=g) for g in gens])
        logits = forward(params, x[idx])
        loss = F.cross_entropy(logits.transpose(1, 2), y[idx], reduction="none").mean(1).sum()
        grads = torch.autograd.grad(loss, params)
        _update(params, grads, lr_at(step), active, adam, step)
        if step in checkpoint_steps:
            out.params_at[step] = [p.detach().clone() for p in params]
        if step % every and step != budget:
            continue
        cur = full_losses(params, x, y).tolist()
        for i in range(k):
            if not active[i]:
                continue
            if not math.isfinite(cur[i]) or cur[i] > cfg.diverge_loss:
                diverged[i], active[i] = True, False
            elif cur[i] <= cfg.target:
                steps[i], active[i] = crossing(step - every, prev[i], step, cur[i], cfg.target), False
        prev = cur
        if not active.any() and step >= max(checkpoint_steps, default=0):
            break
    return out


def _update(params, grads, lr, active, adam, step, beta1=0.9, beta2=0.999, eps=1e-8) -> None:
    """Plain SGD, or Adam (PyTorch's defaults), for every active model; finished models stay frozen."""
    with torch.no_grad():
        for j, (p, g) in enumerate(zip(params, grads)):
            g = torch.nan_to_num(g) * active.view(-1, *([1] * (g.dim() - 1)))
            scale = lr.view(-1, *([1] * (g.dim() - 1)))
            if adam is None:
                p -= scale * g
                continue
            m, v = adam[2 * j], adam[2 * j + 1]
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
            p -= scale * m_hat / (v_hat.sqrt() + eps) * active.view(-1, *([1] * (g.dim() - 1)))


def median_steps(res: StackResult, rows: list[int]) -> tuple[float, int]:
    """Median steps over the seeds of one configuration, and how many of them diverged."""
    return float(np.median([res.steps[i] for i in rows])), sum(res.diverged[i] for i in rows)


# ------------------------------------------------------------------------------------------------ 1. tuning
@dataclass
class Tuned:
    batch_size: int
    lr: float
    steps: float  # median over seeds
    grid: dict[float, tuple[float, int]]  # lr -> (median steps, diverged seeds)


def tune(data, cfg: Config, batch_size: int, lrs: tuple[float, ...], optimizer: str) -> Tuned:
    specs = [RunSpec(lr, seed) for lr in lrs for seed in range(cfg.seeds)]
    res = train_stack(data, cfg, batch_size, specs, optimizer)
    grid = {lr: median_steps(res, list(range(i * cfg.seeds, (i + 1) * cfg.seeds))) for i, lr in enumerate(lrs)}
    best = min(grid, key=lambda lr: (grid[lr][0], -lr))
    return Tuned(batch_size, best, grid[best][0], grid)


# ------------------------------------------------------------------------------------------------ 2. measurements
def mlp_module(params: list[torch.Tensor]) -> torch.nn.Module:
    w1, b1, w2, b2 = (p.detach().clone() for p in params)
    net = torch.nn.Sequential(torch.nn.Linear(64, w1.shape[1]), torch.nn.Tanh(), torch.nn.Linear(w1.shape[1], 10))
    with torch.no_grad():
        net[0].weight.copy_(w1.T), net[0].bias.copy_(b1), net[2].weight.copy_(w2.T), net[2].bias.copy_(b2)
    return net


def exact_parts(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(tr Σ, |G|²)`` over all examples, exactly: ``gns_callback.exact`` per-example gradients."""
    from gns_callback.exact import per_example_gradients

    g = per_example_gradients(mlp_module(params), F.cross_entropy, x, y)
    mean = g.mean(0)
    return (g - mean).pow(2).sum(1).mean().item(), mean.pow(2).sum().item()


def top_eigenvalue(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    net = mlp_module(params)
    return sharpness(lambda: F.cross_entropy(net(x), y), list(net.parameters()), max_iterations=100, rtol=1e-4)


@dataclass
class Along:
    """Along a tuned run (seed 0): run-average B_simple and λ_max at init, the checkpoints and the end."""

    b_run: float  # Σ tr Σ / Σ |G|² over the checkpoints
    b_early: float  # the same over the checkpoints in the first quarter of the run's log-loss range
    lam_init: float
    lam_end: float
    lam_max: float  # the largest along the run (init included)
    lam_median: float
    lr_times_lam: list[float]


def along_run(data, cfg: Config, tuned: Tuned, optimizer: str) -> Along:
    x, y = data
    n = max(1, int(tuned.steps))
    points = tuple(sorted({max(1, round(n * (i + 1) / cfg.checkpoints)) for i in range(cfg.checkpoints)}))
    early = tuple(sorted({max(1, round(n * (i + 1) / (5 * cfg.checkpoints))) for i in range(cfg.checkpoints)}))
    res = train_stack(data, cfg, tuned.batch_size, [RunSpec(tuned.lr, 0)], optimizer,
                      checkpoint_steps=tuple(sorted(set(points + early))))
    snapshots = [init_params(cfg.hidden)] + [[p[0] for p in res.params_at[s]] for s in points if s in res.params_at]
    parts = [exact_parts(p, x, y) for p in snapshots[1:]]
    lams = [top_eigenvalue(p, x, y) for p in snapshots]
    b_run = sum(t for t, _ in parts) / sum(g for _, g in parts)
    dense = [init_params(cfg.hidden)] + [[p[0] for p in res.params_at[s]] for s in sorted(set(points + early))
                                         if s in res.params_at]
    return Along(b_run, early_noise_scale(dense, x, y, cfg.target), lams[0], lams[-1], max(lams),
                 float(np.median(lams)), [tuned.lr * v for v in lams])


def early_noise_scale(snapshots: list[list[torch.Tensor]], x: torch.Tensor, y: torch.Tensor, target: float) -> float:
    """Exact ``Σ tr Σ/Σ |G|²`` over the snapshots (init first) in the first quarter of the log-loss range from
    init to the target: what ``gns_callback.critical_batch.early_window`` estimates from the steps."""
    losses = [full_losses(stacked(p, 1), x, y).item() for p in snapshots]
    depth = np.log(losses[0]) - np.minimum.accumulate(np.log(losses))
    bound = 0.25 * (math.log(losses[0]) - math.log(target))
    parts = [exact_parts(p, x, y) for p, d in zip(snapshots, depth) if d <= bound]
    return sum(t for t, _ in parts) / sum(g for _, g in parts)


# ------------------------------------------------------------------------------------------------ 3. transfer
def warmup_steps_for(factor: float, batch_size: int, n: int) -> int:
    """The recommendation's warmup: ``warmup_epochs_for(factor)`` epochs of ``n`` examples at the new batch."""
    return math.ceil(warmup_epochs_for(factor) * n / batch_size)


#: Row label → (lr_rule, which λ_max to pass as sharpness): the explicit rules, then the family defaults.
SGD_POLICIES = {
    "linear": ("linear", None),
    "noise_linear": ("noise_linear", None),
    "default, no sharpness (holds increases)": (None, None),
    "default, sharpness = λ_max at init": (None, "lam_init"),
    "default, sharpness = λ_max at the end": (None, "lam_end"),
    "default, sharpness = largest λ_max along the run": (None, "lam_max"),
    "default with the early-phase B_noise, no sharpness": ("early", None),
    "default with the early-phase B_noise and the largest λ_max (the callback)": ("early", "lam_max"),
}
ADAM_POLICIES = {"sqrt": ("sqrt", None), "noise_sqrt (default)": (None, None)}


def transfers(tuned: dict[int, Tuned], along: dict[int, Along], family: str) -> list[dict]:
    """Every (B0 → B1, policy) with the LR the recommendation's LR policy gives."""
    optimizer, policies = ("SGD", SGD_POLICIES) if family == "sgd" else ("Adam", ADAM_POLICIES)
    rows = []
    for b0, t0 in tuned.items():
        for b1 in tuned:
            if b1 == b0:
                continue
            b_noise = along[b0].b_run
            for label, (rule, lam) in policies.items():
                lam_value = None if lam is None else getattr(along[b0], lam)
                early = along[b0].b_early if rule == "early" else math.nan
                rule = None if rule == "early" else rule
                lr = choose_lr(t0.lr, b0, b1, optimizer, rule, b_noise=b_noise, sharpness=lam_value,
                               early_b_noise=early).learning_rate
                rows.append(dict(b0=b0, b1=b1, rule=label, lr=lr, lr0=t0.lr, b_noise=b_noise, tuned_lr1=tuned[b1].lr))
    return rows


def run_transfers(data, cfg: Config, rows: list[dict], tuned: dict[int, Tuned], optimizer: str, log) -> None:
    """Run every transferred LR at its B1 (with warmup when it rises); fill in steps and the ratio to tuned."""
    n = len(data[0])
    for b1 in sorted({r["b1"] for r in rows}):
        mine = [r for r in rows if r["b1"] == b1]
        unique = sorted({(round(r["lr"], 6), round(r["lr0"], 6)) for r in mine})
        specs = []
        for lr, lr0 in unique:
            w = warmup_steps_for(lr / lr0, b1, n) if lr > lr0 else 0
            specs += [RunSpec(lr, s, start_lr=lr0 if w else None, warmup_steps=w) for s in range(cfg.seeds)]
        t = time.time()
        res = train_stack(data, cfg, b1, specs, optimizer)
        outcome = {u: median_steps(res, list(range(i * cfg.seeds, (i + 1) * cfg.seeds))) for i, u in enumerate(unique)}
        for r in mine:
            steps, div = outcome[(round(r["lr"], 6), round(r["lr0"], 6))]
            r.update(steps=steps, diverged=div, ratio=steps / tuned[b1].steps)
        log(f"  transfers to B={b1}: {len(unique)} LRs × {cfg.seeds} seeds in {time.time() - t:.1f} s")


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per rule and direction (batch up / down): median and worst ratio to tuned, pairs within 1.25× of tuned,
    pairs that failed (median not reached: diverged), and diverged runs."""
    out = {}
    for rule in dict.fromkeys(r["rule"] for r in rows):
        for direction, keep in (("up", lambda r: r["b1"] > r["b0"]), ("down", lambda r: r["b1"] < r["b0"])):
            mine = [r for r in rows if r["rule"] == rule and keep(r)]
            ratios = [r["ratio"] for r in mine]
            out[f"{rule} | {direction}"] = dict(
                n=len(mine),
                median_ratio=float(np.median(ratios)),
                worst_ratio=float(max(ratios)),
                within_1_25=sum(x <= 1.25 for x in ratios),
                diverged_runs=sum(r["diverged"] for r in mine),
                failed_pairs=sum(not math.isfinite(x) for x in ratios),
            )
    return out


# ------------------------------------------------------------------------------------------------ the benchmark
def run_family(data, cfg: Config, family: str, log) -> dict:
    batches, lrs = (cfg.sgd_batches, cfg.sgd_lrs) if family == "sgd" else (cfg.adam_batches, cfg.adam_lrs)
    tuned, along = {}, {}
    for b in batches:
        t = time.time()
        tuned[b] = tune(data, cfg, b, lrs, family)
        along[b] = along_run(data, cfg, tuned[b], family)
        a = along[b]
        log(f"{family} B={b:4d}: tuned lr {tuned[b].lr:g}, {tuned[b].steps:.0f} steps; run-average B_simple "
            f"{a.b_run:.1f}; λ_max init {a.lam_init:.3g} end {a.lam_end:.3g} max {a.lam_max:.3g}; lr·λ_max "
            f"{min(a.lr_times_lam):.2f}–{max(a.lr_times_lam):.2f} ({time.time() - t:.1f} s)")
    rows = transfers(tuned, along, family)
    run_transfers(data, cfg, rows, tuned, family, log)
    b_crit = fit_b_crit(tuned)
    return dict(tuned={b: vars(t) for b, t in tuned.items()}, along={b: vars(a) for b, a in along.items()},
                transfers=rows, summary=summarize(rows), b_crit=b_crit)


def fit_b_crit(tuned: dict[int, Tuned]) -> float:
    """``B_crit`` from ``S = S_min(1 + B_crit/B)``: least squares of ``S`` on ``1/B`` (McCandlish et al.)."""
    b = np.array(sorted(tuned), dtype=float)
    s = np.array([tuned[int(v)].steps for v in b])
    ok = np.isfinite(s)
    slope, intercept = np.polyfit(1.0 / b[ok], s[ok], 1)
    return float(slope / intercept)


def render(out: dict, command: str, seconds: Optional[float]) -> str:
    cfg = out["config"]
    took = "" if seconds is None else f" ({seconds / 60:.1f} min)"
    lines = [
        f"Command: `{command}`{took}. Hardware: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPU cores (shared), torch {torch.__version__}, {torch.get_num_threads()} thread(s).",
        "",
        f"Digits (1797 examples), MLP 64-{cfg['hidden']}-10 tanh, fixed init, i.i.d. batches with replacement, "
        f"constant LR; steps to full-data cross-entropy ≤ {cfg['target']}, median of {cfg['seeds']} seeds. "
        "Ratio = median steps of the transferred LR at B1 / median steps of the LR tuned at B1 (∞: diverged or not "
        "reached in the budget). B_noise for the noise-aware rules = the exact run-average B_simple of the tuned "
        "run at B0; the *early-phase* rows use the exact B_simple over the first quarter of that run's log-loss "
        "range (init to target), what `critical_batch.early_window` estimates and the callback passes on.",
        "",
        interpretation(out),
    ]
    for family in ("sgd", "adam"):
        fam = out[family]
        lines += ["", f"### {family.upper()}", "",
                  f"B_crit fitted to the tuned steps (S = S_min(1 + B_crit/B), least squares): {fam['b_crit']:.1f}.",
                  "",
                  "| B | tuned lr | steps | run-avg B_simple | early-phase B_simple | λ_max init / end / max "
                  "| lr·λ_max along the run |",
                  "|---|---|---|---|---|---|---|"]
        for b, t in fam["tuned"].items():
            a = fam["along"][b]
            lines.append(f"| {b} | {t['lr']:.4g} | {t['steps']:.0f} | {a['b_run']:.1f} | {a['b_early']:.1f} "
                         f"| {a['lam_init']:.3g} / "
                         f"{a['lam_end']:.3g} / {a['lam_max']:.3g} | {min(a['lr_times_lam']):.2f}–"
                         f"{max(a['lr_times_lam']):.2f} |")
        lines += ["", "| LR policy | batch | pairs | median ratio | worst ratio | within 1.25× | failed pairs | "
                  "diverged runs |", "|---|---|---|---|---|---|---|---|"]
        for key, s in summarize(fam["transfers"]).items():
            lines.append(f"| {key} | {s['n']} | {_ratio(s['median_ratio'])} | {_ratio(s['worst_ratio'])} | "
                         f"{s['within_1_25']} | {s['failed_pairs']} | {s['diverged_runs']} |")
        lines += ["", "<details><summary>Every transfer</summary>", "",
                  "| B0 → B1 | rule | lr0 → lr | tuned lr at B1 | median steps | ratio | diverged |",
                  "|---|---|---|---|---|---|---|"]
        for r in fam["transfers"]:
            lines.append(f"| {r['b0']} → {r['b1']} | {r['rule']} | {r['lr0']:.4g} → {r['lr']:.4g} | "
                         f"{r['tuned_lr1']:.4g} | {r['steps']:.0f} | {_ratio(r['ratio'])} | {r['diverged']} |")
        lines += ["", "</details>"]
    return "\n".join(lines)


def interpretation(out: dict) -> str:
    """What the SGD table says, with its numbers (so that a rerun keeps the text true)."""
    summary = summarize(out["sgd"]["transfers"])
    plain, noise = summary["noise_linear | up"], summary["noise_linear | down"]
    hold = summary["default, no sharpness (holds increases) | up"]
    peak = summary["default, sharpness = largest λ_max along the run | up"]
    lam = [a["lam_max"] for a in out["sgd"]["along"].values()]
    return (
        f"**Reading (SGD).** Lowering the batch, the noise-aware rule lands near the tuned LR (median "
        f"{noise['median_ratio']:.2f}× the tuned steps, worst {noise['worst_ratio']:.2f}×), where linear scaling "
        f"is far too small. Raising it, the noise-aware rule alone failed in {plain['failed_pairs']} of "
        f"{plain['n']} pairs (diverged): a tuned SGD LR already sits at the curvature (stability) limit, which "
        "the noise scale knows nothing about. The sharpness fixes it only if it is the *largest* λ_max seen along "
        f"the run (λ_max peaks within the first sixth of each run, at {min(lam):.2f}–{max(lam):.2f}, then falls): "
        f"capped at 2/λ_max no pair failed (median {peak['median_ratio']:.2f}×, worst {peak['worst_ratio']:.2f}×); "
        "λ_max at init or at the "
        "end never binds. Without a sharpness, holding the LR on an increase also never failed (median "
        f"{hold['median_ratio']:.2f}×, worst {hold['worst_ratio']:.2f}×): that is `recommend()`'s SGD default when "
        "no early-phase noise scale is given. "
        + early_reading(summary, out)
        + adam_reading(out)
    )


def early_reading(summary: dict, out: dict) -> str:
    """The default the callback runs: the rule at the early phase's noise scale (and the largest λ_max)."""
    label = "default with the early-phase B_noise and the largest λ_max (the callback)"
    up, down = summary[f"{label} | up"], summary[f"{label} | down"]
    early = [a["b_early"] for a in out["sgd"]["along"].values()]
    return (
        f"**The callback's default** takes B_noise from the early phase (exact values {min(early):.1f}–"
        f"{max(early):.1f} from the runs at every batch, against the fitted B_crit {out['sgd']['b_crit']:.1f}), the "
        "more cautious of it and the batch's B_noise in each direction, an increase aimed ×0.85 below the rule, "
        "capped at the stability limit only where the run trains below it: up, "
        f"median {up['median_ratio']:.2f}×, worst {_ratio(up['worst_ratio'])}, {up['failed_pairs']} failed pairs, "
        f"{up['diverged_runs']} diverged run(s) of {3 * up['n']}; down, median {down['median_ratio']:.2f}×, worst "
        f"{_ratio(down['worst_ratio'])}, {down['failed_pairs']} failed pairs, {down['diverged_runs']} diverged "
        f"run(s). {_tuned_divergence(out['sgd'])}"
    )


def _tuned_divergence(fam: dict) -> str:
    """Where the grid's own tuned LR diverged on some seeds (the stability edge the rules aim near)."""
    hits = [f"batch {b} ({_grid_at(t)[1]} of the seeds)" for b, t in fam["tuned"].items() if _grid_at(t)[1]]
    return f"The LR tuned on the grid itself diverged at {', '.join(hits)}." if hits else ""


def _grid_at(tuned: dict) -> tuple[float, int]:
    return next((v for k, v in tuned["grid"].items() if abs(float(k) - tuned["lr"]) < 1e-9), (math.nan, 0))


def adam_reading(out: dict) -> str:
    summary = summarize(out["adam"]["transfers"])
    parts = []
    for rule in ("sqrt", "noise_sqrt (default)"):
        up, down = summary[f"{rule} | up"], summary[f"{rule} | down"]
        parts.append(f"{rule.split()[0]} {up['median_ratio']:.2f}× up (worst {up['worst_ratio']:.2f}×), "
                     f"{down['median_ratio']:.2f}× down (worst {down['worst_ratio']:.2f}×)")
    diverged = sum(s["diverged_runs"] for s in summary.values())
    return f" **Adam:** {'; '.join(parts)}; {diverged} diverged runs in all."


def _ratio(x: float) -> str:
    return "∞" if not math.isfinite(x) else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="write the section into this Markdown file (e.g. benchmarks/RESULTS.md)")
    parser.add_argument("--json", help="also save the raw results here")
    parser.add_argument("--from-json", help="render a saved --json file instead of running")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.from_json:
        with open(args.from_json) as f:
            out = json.load(f)
    else:
        out = run(QUICK if args.quick else Config(), print)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    if args.out:
        from benchmarks.results import replace_section

        command = "python benchmarks/lr_transfer_digits.py" + (" --quick" if args.quick else "")
        replace_section(args.out, SECTION_HEADING, render(out, command, out.get("seconds")))
        print(f"wrote {args.out}")


def run(cfg: Config, log: Callable[[str], None]) -> dict:
    start = time.time()
    out: dict = {"config": {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}}
    for family in ("sgd", "adam"):
        out[family] = run_family(load_data(), cfg, family, log)
        for rule, s in out[family]["summary"].items():
            log(f"  {rule:50s} {s}")
    out["seconds"] = time.time() - start
    return out


if __name__ == "__main__":
    main()
