#!/usr/bin/env python
"""Interval calibration of the run average at scale: exact per-step estimates, many data orders.

Each model's per-example gradients are computed once by brute force over all 1797 digits (parameters fixed). A run
is ``--steps`` batches of 32 drawn with replacement; each step's unbiased estimates are

    |G|²  ≈ (B·|G_B|² − mean_i |g_i|²)/(B − 1),    tr Σ ≈ B·(mean_i |g_i|² − |G_B|²)/(B − 1),

the per-example method's at every example (McCandlish et al. 2018, appendix A), and the run's interval is the
package's own (``gns_callback.smoothing.summarize_ratio``: Fieller, Student-t). With the arithmetic exact, the only
error left is the interval's: the share of runs whose interval holds the exact B_simple should be the nominal 95%.

Two sets of data orders per model: the seeds 0..59 that the plain-loop scans of this project reused for every model
(one shared set of draws), and ``--runs`` fresh ones. Each row also gives how the spread of the runs' mean |G|²
compares with the standard error each run reports for it (1 for independent steps, up to sampling error).

    python benchmarks/interval_calibration.py [--runs 1000] [--steps 150]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.model_scan import HandWrittenLayer, MinGptStyle, digits_and_tokens  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from gns_callback.smoothing import step_values, summarize_ratio  # noqa: E402

BATCH = 32


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def step_estimates(grads: torch.Tensor, sq: torch.Tensor, draws: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-step (tr Σ, |G|²) of the batches ``draws`` (steps, B) of example indices."""
    mean_grad = grads[draws].mean(1)
    big, small = (mean_grad * mean_grad).sum(1), sq[draws].mean(1)
    return ((small - big) * BATCH / (BATCH - 1)).numpy(), ((BATCH * big - small) / (BATCH - 1)).numpy()


def calibrate(grads: torch.Tensor, exact: float, seeds: range, steps: int) -> str:
    """Holds, misses below and above the interval, and the |G|² spread ratio over runs with these seeds."""
    sq = (grads * grads).sum(1)
    holds = below = 0
    means, variances = [], []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        draws = torch.stack([torch.randint(0, grads.shape[0], (BATCH,), generator=generator) for _ in range(steps)])
        x, y = step_estimates(grads, sq, draws)
        summary = summarize_ratio(sum(step_values(a, b) for a, b in zip(x, y)))
        holds += summary.ci_low <= exact <= summary.ci_high
        below += exact < summary.ci_low
        means.append(y.mean())
        variances.append(y.var(ddof=1) / steps)
    runs = len(seeds)
    spread = np.std(means, ddof=1) / np.sqrt(np.mean(variances))
    return f"{holds} of {runs} ({holds / runs:.1%}) | {below} | {runs - holds - below} | {spread:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pixels, tokens, labels = digits_and_tokens()
    print("| model | exact B_simple | data orders | intervals holding it | exact below | exact above "
          "| spread of mean |G|² / its reported s.e. |\n|---|---|---|---|---|---|---|")
    for name, make, inputs in [("MLP 64-32-10", mlp, pixels),
                               ("minGPT-style (sliced table)", MinGptStyle, tokens),
                               ("hand-written layer, nn.Linear head", HandWrittenLayer, pixels)]:
        torch.manual_seed(0)
        grads = per_example_gradients(make(), F.cross_entropy, inputs, labels).double()
        exact = exact_noise_scale(grads)[0]
        for label, seeds in (("seeds 0..59", range(60)), (f"{args.runs} fresh", range(1000, 1000 + args.runs))):
            print(f"| {name} | {exact:.1f} | {label} | {calibrate(grads, exact, seeds, args.steps)} |", flush=True)


if __name__ == "__main__":
    main()
