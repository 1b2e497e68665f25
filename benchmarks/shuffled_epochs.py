#!/usr/bin/env python
"""Batches drawn without replacement (shuffled epochs) of small real data sets: the meter with and without the
correction for it, against the exact value.

    python benchmarks/shuffled_epochs.py [--streams 40] [--steps 150] [--out benchmarks/RESULTS.md]

Each case: an MLP (inputs → 32 → GELU → outputs) trained 60 Adam steps on the data set, then held; ``--streams``
runs of ``--steps`` optimizer steps, each over its own shuffled epochs (``DataLoader(shuffle=True, drop_last=True)``)
in a plain loop with ``GradientNoiseScaleMeter`` at its defaults, once with ``population=None`` (the estimates
assume independent draws) and once with ``population=N`` (:mod:`gns_callback.sampling`). Exact = every per-example
gradient over the whole data set at the held parameters (``gns_callback.exact``). Reported: the median of
``B_simple``/exact, the means of ``tr Σ``/exact and ``|G|²``/exact with their standard errors, and how many
intervals hold the exact value. Then one stream per case in the data set's own order (``shuffle=False``, the same
batches every epoch), which the Lightning callback refuses: what the meter would read there. About 90 s on one CPU
core.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import warnings
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sklearn import datasets  # noqa: E402

from benchmarks.results import publish_section  # noqa: E402
from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def standardised(values) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float32)
    return (t - t.mean(0)) / (t.std(0) + 1e-8)


def load(name: str) -> tuple[torch.Tensor, torch.Tensor, Loss, int]:
    """Inputs, targets, loss and output width."""
    if name == "breast_cancer":
        data = datasets.load_breast_cancer()
        bce = lambda out, y: F.binary_cross_entropy_with_logits(out.squeeze(-1), y)  # noqa: E731
        return standardised(data.data), torch.tensor(data.target, dtype=torch.float32), bce, 1
    data = getattr(datasets, f"load_{name}")()
    return standardised(data.data), torch.tensor(data.target), F.cross_entropy, int(data.target.max()) + 1


def trained_mlp(x: torch.Tensor, y: torch.Tensor, loss: Loss, outputs: int) -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(x.shape[1], 32), nn.GELU(), nn.Linear(32, outputs))
    optimizer = torch.optim.Adam(net.parameters(), lr=3e-3)
    for _ in range(60):
        i = torch.randint(0, len(x), (16,))
        optimizer.zero_grad()
        loss(net(x[i]), y[i]).backward()
        optimizer.step()
    optimizer.zero_grad()  # else the first measured step's gradient holds the last training step's
    return net


def shuffled_batches(x: torch.Tensor, y: torch.Tensor, size: int, seed: int) -> Iterator:
    generator = torch.Generator().manual_seed(seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=size, shuffle=True,
                                         drop_last=True, generator=generator)
    while True:
        yield from loader


def ordered_batches(x: torch.Tensor, y: torch.Tensor, size: int) -> Iterator:
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=size, drop_last=True)
    while True:
        yield from loader


def stream(net: nn.Module, loss: Loss, batches: Iterator, method: str, passes: int, size: int, steps: int,
           population: int | None):
    with GradientNoiseScaleMeter(net, method=method, population=population) as meter:
        for _ in range(steps):
            for xb, yb in itertools.islice(batches, passes):
                (loss(net(xb), yb) / passes).backward()
            meter.step(micro_batch_size=size)
            for p in net.parameters():
                p.grad = None
    return meter.run_estimate


def summary(estimates, exact: tuple[float, float, float]) -> str:
    b, g, t = exact
    n = len(estimates)

    def mean_se(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) / n ** 0.5:.3f}"

    holds = sum(e.ci_low <= b <= e.ci_high for e in estimates)
    median = statistics.median(e.b_simple / b for e in estimates)
    return (f"{median:.3f} | {mean_se([e.trace_sigma / t for e in estimates])} "
            f"| {mean_se([e.grad_sq_norm / g for e in estimates])} | {holds}/{n}")


CASES = [("wine", "per_example", 1, 16), ("iris", "per_example", 1, 16), ("wine", "micro_batch", 4, 4),
         ("breast_cancer", "per_example", 1, 32)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", help="replace this section of a markdown file (e.g. benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    rows = ["| data set | N | method, passes × size | exact B_simple | correction | B_simple/exact (median) "
            "| tr Σ/exact | \\|G\\|²/exact | intervals holding exact |", "|---|---|---|---|---|---|---|---|---|"]
    for name, method, passes, size in CASES:
        x, y, loss, outputs = load(name)
        net = trained_mlp(x, y, loss, outputs)
        exact = exact_b_simple(net, loss, x, y)
        for population in (None, len(x)):
            estimates = [stream(net, loss, shuffled_batches(x, y, size, seed), method, passes, size, args.steps,
                                population) for seed in range(args.streams)]
            label = "none (independent draws assumed)" if population is None else f"population={len(x)}"
            rows.append(f"| {name} | {len(x)} | {method}, {passes} × {size} | {exact[0]:.2f} | {label} "
                        f"| {summary(estimates, exact)} |")
            print(rows[-1], flush=True)
    rows += ["", "In the data set's own order (`DataLoader(shuffle=False, drop_last=True)`: the same batches every epoch; "
             "one stream, what the callback refuses at fit start):", "",
             "| data set | method, passes × size | exact B_simple | B_simple [95% CI] | B_simple/exact | holds |",
             "|---|---|---|---|---|---|"]
    for name, method, passes, size in CASES:
        x, y, loss, outputs = load(name)
        net = trained_mlp(x, y, loss, outputs)
        exact = exact_b_simple(net, loss, x, y)[0]
        e = stream(net, loss, ordered_batches(x, y, size), method, passes, size, args.steps, None)
        rows.append(f"| {name} | {method}, {passes} × {size} | {exact:.2f} | {e.b_simple:.2f} [{e.ci_low:.2f}, "
                    f"{e.ci_high:.2f}] | {e.b_simple / exact:.2f} | {'yes' if e.ci_low <= exact <= e.ci_high else 'no'} |")
        print(rows[-1], flush=True)
    intro = (f"Command: `python benchmarks/shuffled_epochs.py --streams {args.streams} --steps {args.steps}`, one "
             f"thread, torch {torch.__version__}. Each stream: {args.steps} optimizer steps over shuffled epochs "
             "(`DataLoader(shuffle=True, drop_last=True)`), the meter at its defaults; standard errors over the "
             "streams.")
    publish_section(intro + "\n\n" + "\n".join(rows), args.out, "## Batches drawn without replacement")


if __name__ == "__main__":
    main()
