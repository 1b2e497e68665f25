#!/usr/bin/env python
"""The recent estimate along runs under other optimizers and data sets, against the exact value at each reading.

    python benchmarks/optimizer_trajectories.py [--seeds 4] [--steps 600] [--out benchmarks/RESULTS.md]

``benchmarks/trajectory_tracking.py`` measures the recent estimate on SGD runs it was built on. This one checks it
where it was not tuned: a 1-hidden-layer MLP (32 tanh units) on scikit-learn's digits, wine and breast-cancer data
(features standardised), trained with Adam, AdamW (weight decay 0.1), SGD with momentum 0.9 and RMSprop at batch 32
drawn with replacement. A plain-loop ``GradientNoiseScaleMeter`` at its defaults measures every step; every 50
steps from step 100 the exact ``B_simple`` of the current parameters is computed by brute force over the whole data
set (``gns_callback.exact``) and compared with ``meter.estimate``.

Reported per case, over ``--seeds`` runs: the geometric mean of estimate/exact over the resolved readings, the
readings that say ``|G|²`` is not resolved (``inf``), how often the 95% interval holds the exact value, and the
misses with their factor.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.results import publish_section  # noqa: E402
from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402

HEADING = "## The recent estimate under other optimizers and data sets (written by the script)"

OPTIMIZERS: dict[str, Callable[[list, float], torch.optim.Optimizer]] = {
    "Adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "AdamW (weight decay 0.1)": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.1),
    "SGD, momentum 0.9": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "RMSprop": lambda params, lr: torch.optim.RMSprop(params, lr=lr),
}
CASES = [("digits", "Adam", 1e-3), ("wine", "Adam", 3e-3), ("breast_cancer", "AdamW (weight decay 0.1)", 1e-3),
         ("digits", "SGD, momentum 0.9", 0.02), ("digits", "RMSprop", 1e-3)]


def data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A bundled scikit-learn data set, features standardised."""
    import sklearn.datasets

    bunch = getattr(sklearn.datasets, f"load_{name}")()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(bunch.target)


def readings(name: str, optimizer: str, lr: float, seed: int, steps: int, every: int = 50) -> list[tuple]:
    """``(step, exact, estimate)`` every ``every`` steps from step 100 of one run."""
    x, y = data(name)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(x.shape[1], 32), nn.Tanh(), nn.Linear(32, int(y.max()) + 1))
    opt = OPTIMIZERS[optimizer](list(net.parameters()), lr)
    g = torch.Generator().manual_seed(seed)
    out = []
    with GradientNoiseScaleMeter(net) as meter:
        for step in range(1, steps + 1):
            i = torch.randint(0, len(x), (32,), generator=g)
            opt.zero_grad()
            F.cross_entropy(net(x[i]), y[i]).backward()
            meter.step()
            if step >= 100 and step % every == 0:
                with meter.paused():
                    out.append((step, exact_b_simple(net, F.cross_entropy, x, y)[0], meter.estimate))
            opt.step()
    return out


def case_row(name: str, optimizer: str, lr: float, seeds: int, steps: int) -> str:
    logs, unresolved, held, total, misses, exact = [], 0, 0, 0, [], []
    for seed in range(seeds):
        for step, truth, estimate in readings(name, optimizer, lr, seed, steps):
            exact.append(truth)
            total += 1
            if math.isfinite(estimate.b_simple) and estimate.b_simple > 0:
                logs.append(math.log(estimate.b_simple / truth))
            else:
                unresolved += 1
            if estimate.ci_low <= truth <= estimate.ci_high:
                held += 1
            else:
                misses.append(f"seed {seed} step {step}: {estimate.b_simple:.0f} [{estimate.ci_low:.0f}, "
                              f"{estimate.ci_high:.0f}] vs {truth:.0f}")
    gm = math.exp(statistics.mean(logs)) if logs else math.nan
    return (f"| {name} | {optimizer}, lr {lr:g} | {min(exact):.0f}–{max(exact):.0f} | {gm:.2f} | {unresolved}/{total} "
            f"| {held}/{total} | {'; '.join(misses) or 'none'} |")


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", help="replace this benchmark's section of this markdown file (RESULTS.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    rows = [case_row(name, optimizer, lr, args.seeds, args.steps) for name, optimizer, lr in CASES]
    command = " ".join(["python benchmarks/optimizer_trajectories.py", *(sys.argv[1:] if argv is None else argv)])
    text = "\n".join([
        f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, one thread, "
        f"{(time.perf_counter() - started) / 60:.1f} min. Readings every 50 steps from step 100; gm = geometric mean "
        "of estimate/exact over the resolved readings; unresolved = readings of `inf` (|G|² not told from zero).", "",
        "| data | optimizer | exact B_simple (range) | gm estimate/exact | unresolved | interval holds exact | misses |",
        "|---|---|---|---|---|---|---|",
        *rows])
    publish_section(text, args.out, HEADING)
    return text


if __name__ == "__main__":
    main()
