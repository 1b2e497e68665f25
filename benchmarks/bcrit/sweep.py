"""McCandlish et al.'s slow measurement of the critical batch: tune the LR per batch size, count the steps to the
target, fit ``S = S_min(1 + B_crit/B)`` (section 2.2 and appendix of "An Empirical Model of Large-Batch
Training", 2018). The seed runs at the best LRs record their per-step traces for the summaries.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from benchmarks.bcrit.problems import Problem
from benchmarks.bcrit.training import Run, train
from benchmarks.critical_batch_digits import fit_hyperbola, seed_resample_fit


@dataclass(frozen=True)
class SweepConfig:
    batch_sizes: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    seeds: int = 3
    first_seed: int = 0  # data-order seeds first_seed … first_seed + seeds − 1 (the first one runs the LR grid)
    max_examples: int = 1_500_000
    max_steps: int = 20_000
    prune_factor: float = 1.5
    evals_per_run: int = 120
    exact_points: int = 60  # exact |G|², tr Σ at about this many evenly spaced steps per recorded run
    neighbours: int = 1  # grid neighbours of the seed-0 best LR also run all seeds (and are recorded)
    record: bool = True  # record the per-step traces of the seed runs (the summaries need them)


@dataclass
class BatchSweep:
    batch_size: int
    grid: list[Run]  # seed 0 over the LR grid
    seed_runs: dict[float, list[Run]]  # candidate lr -> runs over seeds (recorded)
    tuned_lr: float

    @property
    def steps(self) -> float:
        return float(np.mean([r.steps for r in self.seed_runs[self.tuned_lr]]))

    @property
    def steps_sd(self) -> float:
        v = [r.steps for r in self.seed_runs[self.tuned_lr]]
        return float(np.std(v, ddof=1)) if len(v) > 1 else math.nan


def sweep_batch(problem: Problem, data, cfg: SweepConfig, b: int, guess: float, min_lr: float = 0.0) -> BatchSweep:
    """Seed 0 over the LR grid (large LRs first, slow ones cut; LRs below ``min_lr`` skipped), refined by 2^(1/4)
    around its best; then all seeds at the best LR and its neighbours. The tuned LR has the fewest mean steps
    among the LRs where *every* seed reached the target; when none does, the next lower LRs are tried."""
    budget = min(cfg.max_steps, cfg.max_examples // b)
    every = max(1, round(guess / cfg.evals_per_run))
    best, grid = math.inf, []

    def run_seed0(lr: float) -> None:
        nonlocal best
        r = train(problem, data, b, lr, cfg.first_seed, max_steps=budget, eval_every=every,
                  cut_after=cfg.prune_factor * best)
        grid.append(r)
        best = min(best, r.steps)

    for lr in sorted((lr for lr in problem.lrs if lr >= min_lr), reverse=True):
        run_seed0(lr)
    if not math.isfinite(best):
        raise RuntimeError(f"{problem.name}: batch {b}: no LR reached loss {problem.target_loss} in {budget} steps")
    coarse = min(grid, key=lambda r: r.steps).lr
    for lr in (coarse * 2 ** -0.25, coarse * 2 ** 0.25):
        run_seed0(round(lr, 4))
    grid.sort(key=lambda r: r.lr)
    reached = [r for r in grid if math.isfinite(r.steps)]
    i = min(range(len(reached)), key=lambda k: reached[k].steps)
    exact_every = max(1, round(best / cfg.exact_points))
    seed_runs: dict[float, list[Run]] = {}

    def run_seeds(lr: float) -> None:
        seed_runs[lr] = [train(problem, data, b, lr, s, max_steps=budget, eval_every=every, record=cfg.record,
                               exact_every=exact_every)
                        for s in range(cfg.first_seed, cfg.first_seed + cfg.seeds)]

    for r in reached[max(0, i - cfg.neighbours): i + cfg.neighbours + 1]:
        run_seeds(r.lr)
    lower = i - cfg.neighbours - 1
    while not any(_all_reached(v) for v in seed_runs.values()) and lower >= 0:
        run_seeds(reached[lower].lr)
        lower -= 1
    ok = {lr: v for lr, v in seed_runs.items() if _all_reached(v)}
    if not ok:
        raise RuntimeError(f"{problem.name}: batch {b}: no LR reached loss {problem.target_loss} on every seed")
    tuned = min(ok, key=lambda lr: np.mean([r.steps for r in ok[lr]]))
    return BatchSweep(b, grid, seed_runs, tuned)


def _all_reached(runs: list[Run]) -> bool:
    return all(math.isfinite(r.steps) for r in runs)


def sweep(problem: Problem, data, cfg: SweepConfig, log: Callable[[str], None] = print) -> list[BatchSweep]:
    out, guess = [], 4000.0
    for b in cfg.batch_sizes:
        t0 = time.time()
        res = sweep_batch(problem, data, cfg, b, guess, min_lr=out[-1].tuned_lr / 2 if out else 0.0)
        out.append(res)
        if math.isfinite(res.steps):
            guess = res.steps / 1.5
        log(f"{problem.name} B={b:4d} tuned lr {res.tuned_lr:g} S={res.steps:7.1f} ± {res.steps_sd:5.1f} "
            f"({time.time() - t0:5.1f} s) grid: " + " ".join(f"{r.lr:g}:{_short(r)}" for r in res.grid))
    return out


def _short(r: Run) -> str:
    short = {"diverged": "div", "cut": "cut", "stalled": "stall"}
    return f"{r.steps:.0f}" if r.status == "reached" else short.get(r.status, "budget")


def fit_critical_batch(results: list[BatchSweep], bootstrap: int = 1000, seed: int = 0) -> dict:
    """Hyperbola fit of the tuned steps, with a bootstrap over seeds (95% percentile interval)."""
    batch = np.array([r.batch_size for r in results], dtype=float)
    steps = np.array([r.steps for r in results])
    fit = fit_hyperbola(batch, steps)
    rng = np.random.default_rng(seed)
    per_seed = [np.array([x.steps for x in r.seed_runs[r.tuned_lr]]) for r in results]
    boots = [b for b in (seed_resample_fit(batch, per_seed, rng) for _ in range(bootstrap)) if b is not None]
    fit["bootstrap"] = (float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5)))
    return fit
