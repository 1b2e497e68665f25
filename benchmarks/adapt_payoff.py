#!/usr/bin/env python
"""Does ``adapt=True`` pay off? Train to the same target with it and without it, and count steps and examples.

    python benchmarks/adapt_payoff.py [--problems mlp bc_mlp ...] [--seeds 3] [--out benchmarks/RESULTS.md]

Each problem (:mod:`benchmarks.bcrit.problems`: scikit-learn data, batches i.i.d. with replacement, constant LR)
starts at batch 8 with the LR tuned there by ``benchmarks/payoff.py`` (its "far below" row in RESULTS.md,
"Following the recommendation"), far below the knee. Three Lightning fits per data-order seed, each stopped when
the full training-set loss reaches the problem's target:

* ``adapt=False``: the tuned baseline (the callback only measures);
* ``adapt=True`` as it was before this round's change (only a narrow interval acted on, ``Recommendation.actionable``
  read as ``trusted``; and aimed at the recent noise scale, ``cb.estimate``, rather than the run's critical batch);
* ``adapt=True, recent``: acting on ``toward_interval`` too, still aimed at the recent noise scale;
* ``adapt=True`` now: acting on ``toward_interval`` too, aimed at the run's critical batch (what the printed
  recommendation aims at).

Reported: median steps and examples over the seeds, their ratios to the baseline, the changes made, and runs
that missed the target within 6,000 steps. An epoch is the training set's size in examples (adapt decides at
epoch starts). About 10 minutes on one CPU core.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytorch_lightning as pl  # noqa: E402

from benchmarks.bcrit.problems import PROBLEMS, Problem  # noqa: E402
from benchmarks.bcrit.training import full_loss  # noqa: E402
from benchmarks.results import publish_section  # noqa: E402
from gns_callback import GradientNoiseScaleCallback  # noqa: E402
from gns_callback.recommendation.result import Recommendation  # noqa: E402
from tests.helpers import Classifier, quiet_trainer, with_replacement_loader  # noqa: E402

HEADING = "## Adapting the batch during training (`adapt=True`): steps and examples to the target"
START_BATCH = 8
#: The LR tuned at batch 8 by benchmarks/payoff.py (RESULTS.md, "Following the recommendation", far below).
TUNED_LR = {"mlp": 0.5657, "mlp_adam": 0.0113, "mlp_momentum": 0.0673, "cnn": 0.1682, "bc_mlp": 1.131,
            "diabetes_mlp": 0.16}
MAX_STEPS = 6000
ARMS = ("adapt=False", "adapt=True, before", "adapt=True, recent", "adapt=True")


class StopAtTarget(pl.Callback):
    """Counts the examples trained on, and stops the fit once the full training-set loss reaches the target."""

    def __init__(self, problem: Problem, data: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.problem, self.data, self.examples, self.reached = problem, data, 0, False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.examples += len(batch[0])
        if full_loss(module.net, *self.data, self.problem.loss) <= self.problem.target_loss:
            self.reached = trainer.should_stop = True


@contextmanager
def old_policy(arm: str) -> Iterator[None]:
    """The arms' earlier policies, patched in for the fit: aimed at the recent estimate (what ``_adapt`` read before;
    it now reads ``_batch_target``, whose dict also goes into the report), and (``before``) acting only on a narrow
    (trusted) interval."""
    actionable, target = Recommendation.actionable, GradientNoiseScaleCallback._batch_target
    if arm in ("adapt=True, before", "adapt=True, recent"):
        GradientNoiseScaleCallback._batch_target = lambda callback: callback.meter.estimate.to_dict()
    if arm == "adapt=True, before":
        Recommendation.actionable = property(lambda rec: rec.trusted)
    try:
        yield
    finally:
        Recommendation.actionable, GradientNoiseScaleCallback._batch_target = actionable, target


def fit(problem: Problem, data, lr: float, seed: int, arm: str) -> dict:
    torch.manual_seed(seed)
    x, y = data
    loader = with_replacement_loader(x, y, START_BATCH, num_samples=START_BATCH * math.ceil(len(x) / START_BATCH),
                                     seed=seed)
    callback = GradientNoiseScaleCallback(verbose=False, adapt=arm != "adapt=False")
    stop = StopAtTarget(problem, data)
    module = Classifier(problem.make_net(), lr=lr, optimizer=problem.optimizer, loss_fn=problem.loss)
    with tempfile.TemporaryDirectory() as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = quiet_trainer(max_steps=MAX_STEPS, max_epochs=-1, callbacks=[callback, stop], default_root_dir=root)
        with old_policy(arm):
            trainer.fit(module, loader)
    changes = [f"{e['accumulate_grad_batches'][0]}→{e['accumulate_grad_batches'][1]}" for e in callback.adaptations]
    return {"steps": trainer.global_step, "examples": stop.examples, "reached": stop.reached, "changes": changes}


def row(problem: Problem, arm: str, runs: list[dict], base: list[dict]) -> str:
    steps = statistics.median(r["steps"] for r in runs)
    examples = statistics.median(r["examples"] for r in runs)
    base_steps = statistics.median(r["steps"] for r in base)
    base_examples = statistics.median(r["examples"] for r in base)
    changes = "; ".join(" ".join(r["changes"]) or "none" for r in runs)
    missed = sum(not r["reached"] for r in runs)
    return (f"| {problem.name} | {arm} | {steps:.0f} | {examples:.0f} | {steps / base_steps:.2f} | "
            f"{examples / base_examples:.2f} | {changes} | {missed} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", nargs="+", default=list(TUNED_LR), choices=list(TUNED_LR))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", help="replace this section of a markdown file (e.g. benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.time()
    rows = ["| problem | fit | steps (median) | examples (median) | steps / adapt=False | examples / adapt=False "
            "| accumulation changes per seed | missed the target |", "|---|---|---|---|---|---|---|---|"]
    for name in args.problems:
        problem = PROBLEMS[name]
        data = problem.data()
        runs = {arm: [fit(problem, data, TUNED_LR[name], seed, arm) for seed in range(args.seeds)] for arm in ARMS}
        for arm in ARMS:
            rows.append(row(problem, arm, runs[arm], runs["adapt=False"]))
            print(rows[-1], flush=True)
    intro = (
        f"Command: `python benchmarks/adapt_payoff.py --seeds {args.seeds}` ({', '.join(args.problems)}); "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {os.cpu_count()} CPU cores, no "
        f"GPU; torch {torch.__version__} (1 thread); {time.time() - started:.0f} s. Each fit starts at batch "
        f"{START_BATCH} with the LR tuned there (benchmarks/payoff.py), batches i.i.d. with replacement, and stops at "
        "the problem's target loss over the whole training set (median over data-order seeds 0–"
        f"{args.seeds - 1}). `adapt=True, before`: the policy before `toward_interval` counted.")
    publish_section(intro + "\n\n" + "\n".join(rows), args.out, HEADING)


if __name__ == "__main__":
    main()
