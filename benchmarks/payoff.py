"""Does following the recommendation pay off? Train with it to the same target and count (issue 12).

For each problem (scikit-learn digits by default: an MLP and a CNN, plain SGD and Adam; by name, momentum and
the held-out breast-cancer and diabetes problems, :data:`STARTS`) and each starting batch ``B0`` (far below the
knee, near it, far above it):

1. **Baseline.** The LR tuned on a grid at ``B0`` (:func:`benchmarks.bcrit.sweep.sweep_batch`: seed 0 over the
   grid, then every seed at the best LR and its neighbours; tuned = fewest mean steps among the LRs where every
   seed reached the target). Its steps ``S0`` = median over the seeds.
2. **Measure.** A Lightning fit at ``(B0, tuned LR)`` with ``GradientNoiseScaleCallback`` at its defaults
   (``verbose=False``), batches drawn with replacement, stopped when the full training-set loss reaches the
   target; then ``cb.recommendation``, as a user would read it.
3. **Follow.** Train at the recommended global batch ``B1`` with the recommended LR and its warmup (linear from
   the old LR over ``warmup_steps``), every seed; steps ``S1`` = median; a run whose loss rises above twice its
   initial value counts as diverged.
4. **Tuned at B1.** The same grid tuning at ``B1``: how far the recommended LR is from the best LR at that batch.

Reported per case: ``S1/S0`` (steps), ``B1·S1/(B0·S0)`` (examples), ``S1/S1_tuned``, diverged runs. The knee of
each problem is the ``B_crit`` of McCandlish's fit ``S = S_min(1 + B_crit/B)`` through every tuned batch this run
measured (the SGD values agree with ``benchmarks/critical_batch_summary.py``'s 7-batch sweeps).

    python benchmarks/payoff.py --problems mlp mlp_adam --save /tmp/payoff_mlp.pkl
    python benchmarks/payoff.py --problems cnn cnn_adam --save /tmp/payoff_cnn.pkl
    python benchmarks/payoff.py --load /tmp/payoff_mlp.pkl /tmp/payoff_cnn.pkl --out benchmarks/RESULTS.md
    python benchmarks/payoff.py --quick          # smoke run: the digits problems, 6 min on 2 CPU cores
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bcrit.problems import PROBLEMS, Problem  # noqa: E402
from benchmarks.bcrit.sweep import BatchSweep, SweepConfig, fit_critical_batch, sweep_batch  # noqa: E402
from benchmarks.bcrit.training import Run, full_loss, train  # noqa: E402
from benchmarks.results import replace_section  # noqa: E402

SECTION_HEADING = "## Following the recommendation: steps and examples to the target (issue 12)"
STARTS = {"mlp": (8, 32, 512), "mlp_adam": (8, 32, 512), "cnn": (8, 64, 512), "cnn_adam": (8, 64, 512),
          "bc_mlp": (8, 64, 512), "bc_mlp_adam": (8, 64, 512), "bc_mlp_momentum": (8, 64, 512),
          "bc_mlp_rmsprop": (8, 64, 512), "bc_mlp_adagrad": (8, 64, 512),
          "diabetes_mlp": (8, 64, 442), "wine_mlp": (8, 64, 178), "wine_mlp_adam": (8, 64, 178),
          "wine_mlp_momentum": (8, 64, 178),
          "mlp_momentum": (8, 32, 512), "mlp_nesterov": (8, 32, 512), "mlp_adamw": (8, 32, 512),
          "mlp_rmsprop": (8, 32, 512), "mlp_adagrad": (8, 32, 512),
          "mlp_adadelta": (8, 32, 512), "mlp_adafactor": (8, 32, 512)}
# bc_*, diabetes_mlp and wine_mlp: held out (data sets and networks the calibration never saw; diabetes a
# regression); mlp_momentum: an optimizer the critical batch reads low for (a lower bound)
DEFAULT_PROBLEMS = ("mlp", "mlp_adam", "cnn", "cnn_adam")  # the digits problems; the others by name


@dataclass(frozen=True)
class PayoffConfig:
    sweep: SweepConfig = SweepConfig(seeds=3, neighbours=1, record=False)
    measure_seed: int = 0
    quick: bool = False
    divergence_seeds: int = 0  # more data-order seeds at the start and the followed setting, counting divergence
    divergence_first_seed: int = 1000  # the first of them (fresh: the sweeps use seeds 0, 1, 2)


QUICK = PayoffConfig(sweep=SweepConfig(seeds=2, neighbours=0, record=False, max_examples=200_000), quick=True)


@dataclass
class Case:
    problem: str
    start_batch: int
    start: BatchSweep
    recommendation: dict
    measured_steps: int
    follow: list[Run]
    tuned_at_rec: BatchSweep
    seconds: float
    divergence: Optional[tuple[int, int, int, float]] = None  # diverged at the start, followed; seeds; median S1


@dataclass
class ProblemResult:
    problem: str
    description: str
    cases: list[Case] = field(default_factory=list)
    sweeps: dict[int, BatchSweep] = field(default_factory=dict)

    def knee(self) -> dict:
        results = [self.sweeps[b] for b in sorted(self.sweeps)]
        return fit_critical_batch(results) if len(results) >= 3 else dict(b_crit=math.nan, bootstrap=(math.nan,) * 2)


# ------------------------------------------------------------------------------------------------ measuring
def median_steps(runs: list[Run]) -> float:
    return float(np.median([r.steps for r in runs]))


def tuned_steps(sweep: BatchSweep) -> float:
    return median_steps(sweep.seed_runs[sweep.tuned_lr])


def expected_steps(batch_size: int) -> float:
    """A rough guess of the steps to the target, only used to space the loss evaluations."""
    return 200.0 * (1.0 + 40.0 / batch_size)


def tune(problem: Problem, data, cfg: PayoffConfig, b: int, cache: dict[int, BatchSweep]) -> BatchSweep:
    if b not in cache:
        cache[b] = sweep_batch(problem, data, cfg.sweep, b, expected_steps(b))
    return cache[b]


def measure(problem: Problem, data, b: int, lr: float, seed: int, max_steps: int) -> tuple[dict, int]:
    """A Lightning fit at ``(b, lr)`` with the callback at its defaults, stopped at the target: the recommendation."""
    import pytorch_lightning as pl

    from gns_callback import GradientNoiseScaleCallback
    from tests.helpers import Classifier, quiet_trainer, with_replacement_loader

    x, y = data

    class StopAtTarget(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step % every == 0 and full_loss(module.net, x, y, problem.loss) <= problem.target_loss:
                trainer.should_stop = True

    every = max(1, round(expected_steps(b) / 100))
    torch.manual_seed(seed)
    loader = with_replacement_loader(x, y, b, num_samples=b * math.ceil(len(x) / b), seed=seed)
    cb = GradientNoiseScaleCallback(verbose=False)
    module = Classifier(problem.make_net(), lr=lr, optimizer=problem.optimizer, loss_fn=problem.loss)
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(max_steps=max_steps, max_epochs=-1, callbacks=[cb, StopAtTarget()],
                                default_root_dir=root)
        trainer.fit(module, loader)
    rec = cb.recommendation.to_dict()
    rec["critical_batch"] = cb.meter.critical_batch.to_dict()
    return rec, trainer.global_step


def follow(problem: Problem, data, cfg: PayoffConfig, rec: dict, lr0: float, seeds: Optional[range] = None
           ) -> list[Run]:
    """Every seed (default: the sweep's) at the recommended batch, LR and warmup (no cut but the step budget)."""
    b = int(rec["batch_size"])
    lr = rec["learning_rate"] if rec["learning_rate"] is not None else lr0
    budget = min(cfg.sweep.max_steps, cfg.sweep.max_examples // b)
    every = max(1, round(expected_steps(b) / cfg.sweep.evals_per_run))
    warmup = int(rec.get("warmup_steps") or 0)
    seeds = seeds or range(cfg.sweep.first_seed, cfg.sweep.first_seed + cfg.sweep.seeds)
    return [train(problem, data, b, lr, s, max_steps=budget, eval_every=every, warmup_steps=warmup,
                  warmup_start_lr=lr0) for s in seeds]


def divergence(problem: Problem, data, cfg: PayoffConfig, b0: int, lr0: float, rec: dict
               ) -> tuple[int, int, int, float]:
    """Diverged runs over ``cfg.divergence_seeds`` fresh data-order seeds at the start ``(b0, lr0)`` and at the
    followed setting (is a divergence the recommendation's, or the tuned start LR's own?), the number of seeds, and
    the median steps of the followed runs that reached the target."""
    seeds = range(cfg.divergence_first_seed, cfg.divergence_first_seed + cfg.divergence_seeds)
    start = follow(problem, data, cfg, {"batch_size": b0, "learning_rate": lr0}, lr0, seeds)
    followed = follow(problem, data, cfg, rec, lr0, seeds)
    reached = [r.steps for r in followed if r.status == "reached"]
    return (sum(r.status == "diverged" for r in start), sum(r.status == "diverged" for r in followed), len(seeds),
            float(np.median(reached)) if reached else math.inf)


def run_case(problem: Problem, data, cfg: PayoffConfig, b0: int, result: ProblemResult,
             log: Callable[[str], None]) -> Case:
    t0 = time.time()
    start = tune(problem, data, cfg, b0, result.sweeps)
    budget = int(4 * max(r.steps for r in start.seed_runs[start.tuned_lr]))
    rec, steps = measure(problem, data, b0, start.tuned_lr, cfg.measure_seed, budget)
    runs = follow(problem, data, cfg, rec, start.tuned_lr)
    at_rec = tune(problem, data, cfg, int(rec["batch_size"]), result.sweeps)
    diverged = divergence(problem, data, cfg, b0, start.tuned_lr, rec) if cfg.divergence_seeds else None
    case = Case(problem.name, b0, start, rec, steps, runs, at_rec, time.time() - t0, diverged)
    log(f"{problem.name} B0={b0} lr0={start.tuned_lr:g} S0={tuned_steps(start):.0f} -> B1={rec['batch_size']} "
        f"lr={rec['learning_rate']} warmup={rec.get('warmup_steps')} S1={median_steps(runs):.0f} "
        f"({[r.status for r in runs]}), tuned at B1: lr {at_rec.tuned_lr:g} S={tuned_steps(at_rec):.0f} "
        f"[{case.seconds:.0f} s]")
    return case


def run_problem(name: str, cfg: PayoffConfig, log: Callable[[str], None]) -> ProblemResult:
    problem = PROBLEMS[name]
    data = problem.data()
    result = ProblemResult(name, problem.description)
    for b0 in STARTS[name][::2] if cfg.quick else STARTS[name]:
        result.cases.append(run_case(problem, data, cfg, b0, result, log))
    return result


# ------------------------------------------------------------------------------------------------ reading
TARGETS = {
    "far below": "steps ≤ 0.6×",
    "near": "steps and examples ≤ 1.5×",
    "far above": "examples ≤ 0.5× at steps ≤ 2.5×",
}


def where(b0: int, b_crit: float) -> str:
    """Far below (B0 ≤ B_crit/3), far above (B0 ≥ 3·B_crit) or near the knee."""
    if b0 <= b_crit / 3:
        return "far below"
    if b0 >= 3 * b_crit:
        return "far above"
    return "near"


def case_numbers(case: Case) -> dict:
    s0, s1 = tuned_steps(case.start), median_steps(case.follow)
    b0, b1 = case.start_batch, int(case.recommendation["batch_size"])
    return dict(s0=s0, s1=s1, steps=s1 / s0, examples=b1 * s1 / (b0 * s0), b1=b1,
                vs_tuned=s1 / tuned_steps(case.tuned_at_rec),
                diverged=sum(r.status == "diverged" for r in case.follow),
                not_reached=sum(not math.isfinite(r.steps) for r in case.follow))


def meets(kind: str, n: dict) -> bool:
    if n["diverged"] or n["not_reached"] or n["vs_tuned"] > 1.3:
        return False
    if kind == "far below":
        return n["steps"] <= 0.6
    if kind == "far above":
        return n["examples"] <= 0.5 and n["steps"] <= 2.5
    return n["steps"] <= 1.5 and n["examples"] <= 1.5


def _lr(rec: dict, lr0: float) -> str:
    lr = rec["learning_rate"]
    return f"{lr0:.4g} → {lr:.4g}" if lr is not None else f"{lr0:.4g} (kept)"


def render_problem(res: ProblemResult) -> list[str]:
    knee = res.knee()
    lines = [f"### {res.description}", "",
             f"Knee: B_crit = {knee['b_crit']:.1f} (bootstrap {knee['bootstrap'][0]:.1f} – "
             f"{knee['bootstrap'][1]:.1f}) from the tuned steps at B = {', '.join(map(str, sorted(res.sweeps)))}.", "",
             "| start | B0, tuned LR | S0 | recommended B1, LR, warmup | B_crit read (trust band) | S1 "
             "| steps S1/S0 | examples | tuned LR at B1, its steps | S1 / tuned | diverged | target | met |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in res.cases:
        n, rec = case_numbers(case), case.recommendation
        kind = where(case.start_batch, knee["b_crit"])
        crit = rec["critical_batch"]
        lines.append(
            f"| {kind} | {case.start_batch}, {case.start.tuned_lr:.4g} | {n['s0']:.0f} "
            f"| {n['b1']}, {_lr(rec, case.start.tuned_lr)}, {rec.get('warmup_steps') or 0} "
            f"| {_band(crit)} | {_steps(n['s1'])} "
            f"| {n['steps']:.2f} | {n['examples']:.2f} | {case.tuned_at_rec.tuned_lr:.4g}, "
            f"{tuned_steps(case.tuned_at_rec):.0f} | {n['vs_tuned']:.2f} | {n['diverged']} | {TARGETS[kind]}"
            f" | {'yes' if meets(kind, n) else '**no**'} |")
    rates = [_divergence(where(c.start_batch, knee["b_crit"]), c) for c in res.cases if c.divergence is not None]
    if rates:
        lines += ["", "Diverged over fresh data-order seeds, at the start's tuned LR and at the followed setting "
                  "(median steps of the followed runs that reached the target): " + "; ".join(rates) + "."]
    return lines + [""]


def _divergence(kind: str, case: Case) -> str:
    start, followed, seeds, steps = case.divergence
    return f"{kind} (B0 = {case.start_batch}): start {start}/{seeds}, followed {followed}/{seeds} ({_steps(steps)})"


def _band(crit: dict) -> str:
    value, lo, hi = crit.get("b_crit"), crit.get("trust_low"), crit.get("trust_high")
    if value is None:
        return "not measured"
    return f"{value:.1f} ({lo:.0f} – {hi:.0f})" if lo is not None and hi is not None else f"{value:.1f}"


def _steps(s: float) -> str:
    return f"{s:.0f}" if math.isfinite(s) else "∞"


def render(results: list[ProblemResult], command: str, seconds: float) -> str:
    head = [f"- Commands: `{command}`.",
            f"- Date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
            f"{os.cpu_count()} CPU cores shared with other work, no GPU; torch {torch.__version__} (1 thread), "
            f"Python {platform.python_version()}; {seconds:.0f} s wall for the runs rendered here.",
            "- Setup: scikit-learn data (digits: 1,500 training images; held out from the calibration: breast "
            "cancer, all 569 examples, and the diabetes regression, all 442), batches i.i.d. with replacement, "
            "constant LR (plus the recommended warmup), steps counted until the full training-set loss (each "
            "problem's: cross-entropy, or MSE for diabetes) reaches the target; "
            "median of 3 data-order seeds. The recommendation is read from one measuring fit (seed 0) in Lightning "
            "with the callback at its defaults. `met` = the issue's target for the start's position, no diverged "
            "run, and S1 within 1.3× of the tuned LR's steps at B1.",
            ""]
    body = [line for res in results for line in render_problem(res)]
    return "\n".join(head + body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--problems", nargs="+", default=list(DEFAULT_PROBLEMS), choices=list(STARTS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--save", help="pickle the results here")
    parser.add_argument("--load", nargs="+", help="render pickled results instead of running")
    parser.add_argument("--out", help="replace this benchmark's section in a RESULTS.md")
    parser.add_argument("--divergence-seeds", type=int, default=0,
                        help="also count diverged runs over this many fresh seeds at the start and followed settings")
    parser.add_argument("--divergence-first-seed", type=int, default=1000, help="the first of those seeds")
    a = parser.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    command = "python " + " ".join(sys.argv)
    if a.load:
        results, seconds, runs = [], 0.0, []
        for path in a.load:
            with open(path, "rb") as f:
                saved = pickle.load(f)
            results += saved["results"]
            seconds += saved["seconds"]
            runs.append(saved.get("command", path))
        command = "`; `".join(runs + [command])
    else:
        cfg = replace(QUICK if a.quick else PayoffConfig(), divergence_seeds=a.divergence_seeds,
                      divergence_first_seed=a.divergence_first_seed)
        results = [run_problem(name, cfg, lambda m: print(m, flush=True)) for name in a.problems]
        seconds = time.time() - t0
        if a.save:
            with open(a.save, "wb") as f:
                pickle.dump(dict(results=results, seconds=seconds, command=command), f)
    text = render(results, command, seconds)
    print(SECTION_HEADING + "\n\n" + text)
    if a.out:
        replace_section(a.out, SECTION_HEADING, text)


if __name__ == "__main__":
    main()
