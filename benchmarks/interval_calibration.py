#!/usr/bin/env python
"""Interval calibration of the run average at scale: exact per-step estimates, many data orders.

Each model's per-example gradients are computed once by brute force over all 1797 digits (parameters fixed), and
kept as their Gram matrix ``K_ij = g_i·g_j``. A run is ``--steps`` batches of 32 drawn with replacement; each
step's unbiased estimates are

    |G|²  ≈ (B·|G_B|² − mean_i |g_i|²)/(B − 1),    tr Σ ≈ B·(mean_i |g_i|² − |G_B|²)/(B − 1),

the per-example method's at every example (McCandlish et al. 2018, appendix A), with ``|G_B|² = Σ_ij K_ij/B²``
over the batch. The run's interval is the package's own (``gns_callback.smoothing.summarize_ratio``: Fieller), so
the only error left is the interval's: the share of runs whose interval holds the exact B_simple should be the
nominal 95%. Two intervals per run, from the same sums:

- ``t(n − 1)``: Student-t at ``n − 1`` degrees of freedom (the second-order sums alone: the interval before the
  fourth moments were kept);
- ``kurtosis``: the package's, Student-t at the degrees of freedom the steps' kurtosis leaves
  (:func:`gns_callback.confidence.kurtosis_dof`).

Models: the MLP, minGPT-style and hand-written layer of the earlier rows; the MLP after 60 epochs of SGD (a few
examples carry most of the gradient late in training); with ``transformers`` installed, Hugging Face's Swin (15
of the 1797 examples carry nearly all of its gradient at initialisation), PoolFormer and BEiT.

    python benchmarks/interval_calibration.py [--runs 1000] [--steps 50,150,500] [--only Swin]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks.model_scan import MODELS, HandWrittenLayer, MinGptStyle, digits_and_tokens  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from gns_callback.smoothing import SECOND_ORDER_FIELDS, moment_columns, summarize_ratio  # noqa: E402

BATCH = 32
HUGGING_FACE = ("Hugging Face SwinModel (windows of the examples as rows)",
                "Hugging Face PoolFormerModel (GroupNorm subclass, layer scale through unsqueeze(-1))",
                "Hugging Face BeitModel (layer scale, relative-position table)")


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def trained_mlp(epochs: int = 60) -> nn.Module:
    """:func:`mlp` after ``epochs`` of SGD (lr 0.1, batch 32) on the digits."""
    net, (pixels, _, labels) = mlp(), digits_and_tokens()
    optimizer, order = torch.optim.SGD(net.parameters(), lr=0.1), torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for batch in torch.randperm(len(labels), generator=order).split(BATCH):
            optimizer.zero_grad()
            F.cross_entropy(net(pixels[batch]), labels[batch]).backward()
            optimizer.step()
    return net


def models() -> list[tuple[str, Callable[[], nn.Module], bool]]:
    """(name, model, reads tokens) of every model of this benchmark available here."""
    listed = [("MLP 64-32-10", mlp, False), ("minGPT-style (sliced table)", MinGptStyle, True),
              ("hand-written layer, nn.Linear head", HandWrittenLayer, False),
              ("MLP 64-32-10 after 60 epochs of SGD", trained_mlp, False)]
    return listed + [(name.split(" (")[0], *MODELS[name]) for name in HUGGING_FACE if name in MODELS]


def step_estimates(gram: np.ndarray, draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-step (tr Σ̂, |Ĝ|²) of the batches ``draws`` (steps, B) of example indices, from the Gram matrix."""
    small = np.diag(gram)[draws].mean(1)
    big = gram[draws[:, :, None], draws[:, None, :]].sum((1, 2)) / BATCH**2
    return (small - big) * BATCH / (BATCH - 1), (BATCH * big - small) / (BATCH - 1)


def tally(gram: np.ndarray, exact: float, runs: int, steps: int) -> dict[str, list[float]]:
    """Per interval (``t(n − 1)``, ``kurtosis``): holds, exact below, exact above, and each run's width."""
    rng = np.random.default_rng(steps)
    counts: dict[str, list] = {"t(n − 1)": [0, 0, 0, []], "kurtosis": [0, 0, 0, []]}
    for _ in range(runs):
        x, y = step_estimates(gram, rng.integers(0, gram.shape[0], (steps, BATCH)))
        sums = [float(column.sum()) for column in moment_columns(x, y, np.ones_like(x))]
        for name, summary in zip(counts, (summarize_ratio(sums[:SECOND_ORDER_FIELDS]), summarize_ratio(sums))):
            where = 0 if summary.ci_low <= exact <= summary.ci_high else (1 if exact < summary.ci_low else 2)
            counts[name][where] += 1
            counts[name][3].append(summary.ci_high - summary.ci_low)
    return counts


def row(name: str, exact: float, steps: int, runs: int, counts: dict[str, list]) -> str:
    before, after = counts["t(n − 1)"], counts["kurtosis"]
    widths = np.array(after[3]) / np.array(before[3])
    bounded = np.isfinite(widths)
    median = f"{np.median(widths[bounded]):.3f}" if bounded.any() else "—"
    cells = [f"{c[0]} ({c[0] / runs:.1%}) | {c[1]} | {c[2]}" for c in (before, after)]
    return (f"| {name} | {exact:.1f} | {steps} | {cells[0]} | {cells[1]} | {median} "
            f"| {1 - bounded.mean():.0%} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--steps", default="50,150,500", help="steps per run, comma-separated")
    parser.add_argument("--only", help="only the models whose name contains this (e.g. Swin)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pixels, tokens, labels = digits_and_tokens()
    print("| model | exact B_simple | steps | t(n − 1): holds | below | above | kurtosis: holds | below | above "
          "| median width, kurtosis / t(n − 1) | unbounded |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for name, make, reads_tokens in models():
        if args.only and args.only not in name:
            continue
        torch.manual_seed(0)
        net = make().eval()  # dropout off: the exact value is then one number, not a draw
        grads = per_example_gradients(net, F.cross_entropy, tokens if reads_tokens else pixels, labels).double()
        exact, gram = exact_noise_scale(grads)[0], (grads @ grads.T).numpy()
        for steps in (int(s) for s in args.steps.split(",")):
            print(row(name, exact, steps, args.runs, tally(gram, exact, args.runs, steps)), flush=True)


if __name__ == "__main__":
    main()
