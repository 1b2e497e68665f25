"""What the real Lightning callback reports and recommends on a BatchNorm CNN, against the slow-way critical batch.

The digits CNN with ``BatchNorm2d`` (``benchmarks/bcrit/problems.py``: ``cnn_bn``, ``cnn_bn_momentum``), trained in
train mode (batch statistics), is fitted with ``GradientNoiseScaleCallback`` at given batches and LRs (the LRs
tuned by ``benchmarks/critical_batch_summary.py``), batches drawn with replacement, stopped when the full
training-set loss (eval mode) reaches the problem's target:

* ``defaults``: the callback at its defaults on one device, ``accumulate_grad_batches=1`` (what a user does first);
* ``accumulate``: the fix the callback names, ``accumulate_grad_batches=2`` at the same global batch (loader batch
  B/2: BatchNorm then normalises over B/2 examples per backward pass).

Per fit: the refusal (if any), the recent and run-average B_simple with their intervals, the critical batch with
its interval and trust range, the recommendation's status and batch.

    python benchmarks/batch_norm_callback.py --problem cnn_bn --runs 32:0.4 128:0.4 --seeds 0 1
    python benchmarks/batch_norm_callback.py --problem cnn_bn_ghost2 --slow-way   # B_crit of what accumulating trains
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from benchmarks.bcrit.problems import PROBLEMS, Problem  # noqa: E402
from benchmarks.bcrit.training import full_loss  # noqa: E402


def fit(problem: Problem, data, batch: int, lr: float, seed: int, accumulate: int, max_steps: int = 4000) -> dict:
    """One Lightning fit with the callback at its defaults; ``batch`` is the global batch (loader batch
    ``batch // accumulate``)."""
    import pytorch_lightning as pl

    from gns_callback import GradientNoiseScaleCallback
    from tests.helpers import Classifier, quiet_trainer, with_replacement_loader

    x, y = data

    class StopAtTarget(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch_, batch_idx):
            if trainer.global_step % 5 == 0 and full_loss(module.net, x, y, problem.loss) <= problem.target_loss:
                trainer.should_stop = True

    torch.manual_seed(seed)
    micro = batch // accumulate
    loader = with_replacement_loader(x, y, micro, num_samples=micro * accumulate * max_steps, seed=seed)
    cb = GradientNoiseScaleCallback(verbose=False)
    module = Classifier(problem.make_net(), lr=lr, optimizer=problem.optimizer, loss_fn=problem.loss)
    out = dict(batch=batch, lr=lr, seed=seed, accumulate=accumulate)
    with tempfile.TemporaryDirectory() as root:
        trainer = quiet_trainer(max_steps=max_steps, max_epochs=-1, accumulate_grad_batches=accumulate,
                                callbacks=[cb, StopAtTarget()], default_root_dir=root)
        try:
            trainer.fit(module, loader)
        except Exception as error:  # a refusal: the message is the result
            out.update(refused=f"{type(error).__name__}: {error}", steps=trainer.global_step)
            return out
    out.update(steps=trainer.global_step, loss=full_loss(module.net, x, y, problem.loss), method=cb.meter.method,
               problem=getattr(cb.meter, "_problem", None))
    for key, est in (("recent", cb.estimate), ("run", cb.run_estimate)):
        out[key] = (est.b_simple, est.ci_low, est.ci_high) if est is not None else None
    crit = cb.meter.critical_batch
    out["critical"] = (crit.b_crit, crit.ci_low, crit.ci_high, crit.trust_low, crit.trust_high, crit.method)
    rec = cb.recommendation
    out["rec"] = (rec.status, rec.batch_size, rec.learning_rate, rec.reason) if rec is not None else None
    out["warmup"] = rec.warmup_steps if rec is not None else None
    return out


def slow_way(problem: Problem, data) -> None:
    """McCandlish's slow B_crit without the per-step traces (``benchmarks/bcrit/sweep.py``), printed as a table."""
    from benchmarks.bcrit.sweep import SweepConfig, fit_critical_batch, sweep

    results = sweep(problem, data, SweepConfig(record=False), log=lambda line: print(line, flush=True))
    fit = fit_critical_batch(results)
    print(f"\n**B_crit = {fit['b_crit']:.1f}** (bootstrap over seeds {fit['bootstrap'][0]:.1f} – "
          f"{fit['bootstrap'][1]:.1f}; S_min = {fit['s_min']:.0f}, E_min = {fit['e_min']:,.0f})\n")
    print("| B | tuned LR | S (mean ± sd over seeds) | E = B·S |\n|---|---|---|---|")
    for r in results:
        print(f"| {r.batch_size} | {r.tuned_lr:g} | {r.steps:.0f} ± {r.steps_sd:.0f} | "
              f"{r.batch_size * r.steps:,.0f} |")


FOLLOW_PROBLEM = {"cnn_bn": "cnn_bn_ghost2", "cnn_bn_momentum": "cnn_bn_ghost2_momentum"}


def follow(problem: Problem, data, r: dict, seeds=(0, 1, 2)) -> str:
    """Payoff of a moved batch, as ``benchmarks/payoff.py`` judges it: every seed at the start ``(B0, LR0)`` and at
    the recommended batch, LR and warmup (linear from LR0), trained as the run that measured it trains (BatchNorm
    over each half of the batch: ``accumulate_grad_batches=2`` kept); median steps, their ratio and the examples'."""
    import numpy as np

    from benchmarks.bcrit.training import train

    status, b1, lr1, _ = r["rec"]
    b0, lr0 = r["batch"], r["lr"]
    lr1 = lr1 if lr1 is not None else lr0
    warmup = int(r.get("warmup") or 0)

    def runs(b, lr, warm):
        return [train(problem, data, b, lr, s, max_steps=min(20_000, 1_500_000 // b), eval_every=5,
                      warmup_steps=warm, warmup_start_lr=lr0 if warm else None) for s in seeds]

    start, moved = runs(b0, lr0, 0), runs(b1, lr1, warmup)
    s0 = float(np.median([x.steps for x in start]))
    s1 = float(np.median([x.steps for x in moved]))
    diverged = sum(x.status == "diverged" for x in moved)
    return (f"| {b0} → {b1} | {lr0:g} → {lr1:.4g} (warmup {warmup}) | {s0:.0f} | {s1:.0f} | ×{s1 / s0:.2f} | "
            f"×{b1 * s1 / (b0 * s0):.2f} | {diverged}/{len(seeds)} |")


def row(r: dict, b_crit: float) -> str:
    """One markdown row: the fit's numbers and the reading over the slow-way ``b_crit``."""
    head = f"| {r['batch']} | {r['lr']:g} | {r['accumulate']} | {r['seed']} | {r['steps']} |"
    if "refused" in r:
        return head + f" refused: {r['refused'][:300]} | | | | |"
    fmt = lambda t: f"{t[0]:.4g} [{t[1]:.4g}, {t[2]:.4g}]" if t else "–"  # noqa: E731
    c = r["critical"]
    trust = c[3] <= b_crit <= c[4]
    status, rec_batch = (r["rec"][0], r["rec"][1]) if r["rec"] else ("–", "–")
    toward = ("kept" if rec_batch == r["batch"] else
              "toward" if abs(math.log(rec_batch / b_crit)) < abs(math.log(r["batch"] / b_crit)) else "away")
    return (head + f" {r['method']} | {fmt(r['run'])} | {c[0]:.4g} [{c[1]:.4g}, {c[2]:.4g}] ({c[0] / b_crit:.2f}×; "
            f"trust {'holds' if trust else 'EXCLUDES'} B_crit) | {status}: {r['batch']} → {rec_batch} ({toward}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", default="cnn_bn", choices=sorted(PROBLEMS))
    parser.add_argument("--runs", nargs="+", default=[], help="batch:lr pairs (the slow way's tuned LRs)")
    parser.add_argument("--slow-way", action="store_true", help="only the slow-way B_crit of --problem (no traces)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--accumulate", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--follow", action="store_true", help="train at each moved recommendation (3 seeds)")
    parser.add_argument("--b-crit", type=float, default=math.nan, help="the slow-way B_crit, for the ratios")
    args = parser.parse_args()
    torch.set_num_threads(1)
    problem = PROBLEMS[args.problem]
    data = problem.data()
    if args.slow_way:
        slow_way(problem, data)
        return
    print("| B | LR | accumulate | seed | steps | method | run-average B_simple [CI] | critical batch [CI] "
          f"(/ slow-way {args.b_crit:g}) | recommendation |")
    print("|---|---|---|---|---|---|---|---|---|")
    follows: list[str] = []
    for spec in args.runs:
        batch, lr = int(spec.split(":")[0]), float(spec.split(":")[1])
        for accumulate in args.accumulate:
            for seed in args.seeds:
                t0 = time.time()
                r = fit(problem, data, batch, lr, seed, accumulate)
                print(row(r, args.b_crit) + f" <!-- {time.time() - t0:.0f} s -->", flush=True)
                if args.follow and r.get("rec") and r["rec"][1] != batch:
                    follows.append(follow(PROBLEMS[FOLLOW_PROBLEM.get(args.problem, args.problem)], data, r))
                if "rec" in r and r["rec"]:
                    print(f"<!-- reason: {r['rec'][3]} | recent {r['recent']} | problem {r['problem']} -->",
                          flush=True)
    if follows:
        print("\n| batch | LR | S0 (median) | S1 (median) | steps | examples | diverged |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(follows))


if __name__ == "__main__":
    main()
