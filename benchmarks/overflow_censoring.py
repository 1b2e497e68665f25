"""Steps an AMP GradScaler skips for overflow, left out of the estimate: how far that biases ``B_simple``.

    python benchmarks/overflow_censoring.py [--batches 20000] [--steps 600]

A GradScaler skips a step whose gradient holds inf or NaN. While its scale is still too large every batch overflows,
whatever its examples; once a batch fits, a later batch overflows only where its gradient is larger than the
scale allows, so the steps left out are the batches with the largest gradients. Two parts:

1. **Left out by size.** Exact per-example gradients (``gns_callback.exact``, float64, every example) of two MLPs
   after 100 SGD steps: digits 64-32-10 and breast cancer 30-16-2. ``--batches`` batches of 32 drawn with
   replacement; the batches whose largest batch-gradient element is in the top ``q`` are left out, and the two
   unbiased parts (``tr Σ`` and ``|G|²`` from each batch's small- and big-batch norms) averaged over the rest.
2. **A real GradScaler.** The plain-loop meter at its defaults on the digits MLP at fixed parameters (lr 0), under
   float16 autocast on the CPU with a ``torch.amp.GradScaler`` at its default start, for several
   ``growth_interval`` values: the share of steps that overflowed after the first that did not, the reading, and
   whether the meter withholds it (``gns_callback.overflows``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from gns_callback.overflows import OverflowCount  # noqa: E402

SHARES = (0.0, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
GROWTH_INTERVALS = (1, 10, 100, 2000)


def data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_breast_cancer, load_digits
    if name == "digits":
        d = load_digits()
        return torch.tensor(d.data, dtype=torch.float32) / 16, torch.tensor(d.target)
    d = load_breast_cancer()
    x = torch.tensor(d.data, dtype=torch.float32)
    return (x - x.mean(0)) / x.std(0), torch.tensor(d.target)


def trained_mlp(name: str, x: torch.Tensor, y: torch.Tensor, steps: int = 100) -> nn.Module:
    torch.manual_seed(0)
    width, classes = (32, 10) if name == "digits" else (16, 2)
    net = nn.Sequential(nn.Linear(x.shape[1], width), nn.Tanh(), nn.Linear(width, classes))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(steps):
        i = torch.randint(0, len(x), (32,))
        optimizer.zero_grad()
        F.cross_entropy(net(x[i]), y[i]).backward()
        optimizer.step()
    return net


def batch_parts(rows: torch.Tensor, batches: int, batch: int = 32, seed: int = 0):
    """Per batch: the unbiased ``tr Σ`` and ``|G|²`` from its norms, and its largest batch-gradient element."""
    generator = torch.Generator().manual_seed(seed)
    index = torch.randint(0, len(rows), (batches, batch), generator=generator)
    small = rows.pow(2).sum(1)[index].mean(1)
    big, largest = [], []
    for chunk in index.split(500):
        mean = rows[chunk].mean(1)
        big.append(mean.pow(2).sum(1))
        largest.append(mean.abs().amax(1))
    big = torch.cat(big)
    trace = (small - big) * batch / (batch - 1)
    return trace, big - trace / batch, torch.cat(largest)


def left_out_by_size(trace, grad_sq, largest, share: float) -> float:
    """``B_simple`` over the batches kept when the top ``share`` by largest element is left out."""
    keep = largest <= torch.quantile(largest, 1 - share) if share > 0 else torch.ones_like(largest, dtype=torch.bool)
    return float(trace[keep].mean() / grad_sq[keep].mean())


def part_one(batches: int) -> list[str]:
    lines = ["| case | exact B_simple | " + " | ".join(f"{q:.1%} left out" for q in SHARES) + " |",
             "|---|---|" + "---|" * len(SHARES)]
    for name in ("digits", "breast cancer"):
        x, y = data("digits" if name == "digits" else "bc")
        rows = per_example_gradients(trained_mlp(name, x, y), F.cross_entropy, x, y)
        exact = exact_noise_scale(rows)[0]
        parts = batch_parts(rows, batches)
        cells = [f"{left_out_by_size(*parts, q) / exact:.2f}×" for q in SHARES]
        lines.append(f"| {name} MLP | {exact:.1f} | " + " | ".join(cells) + " |")
    return lines


def scaled_run(growth_interval: int, steps: int, seed: int = 0):
    """The meter on the digits MLP at lr 0 under float16 autocast with a GradScaler at its default start (2^16).
    Returns (meter, steps overflowed after the first finite one, steps from that one on)."""
    x, y = data("digits")
    net = trained_mlp("digits", x, y)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.0)
    scaler = torch.amp.GradScaler("cpu", growth_interval=growth_interval)
    generator, settled, overflowed = torch.Generator().manual_seed(seed), 0, 0
    with warnings.catch_warnings(), GradientNoiseScaleMeter(net) as meter:
        warnings.simplefilter("ignore")
        for _ in range(steps):
            i = torch.randint(0, len(x), (32,), generator=generator)
            scale = scaler.get_scale()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(net(x[i]), y[i])
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            finite = all(torch.isfinite(p.grad).all() for p in net.parameters())
            settled += bool(finite or settled)
            overflowed += bool(settled and not finite)
            meter.step(loss_scale=scale)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return meter, overflowed, settled


def without_the_rule(meter: GradientNoiseScaleMeter):
    """The run average as the meter read it before it withheld estimates for overflowed steps."""
    kept, meter.overflows = meter.overflows, OverflowCount()
    try:
        return meter.run_estimate
    finally:
        meter.overflows = kept


def part_two(steps: int) -> list[str]:
    x, y = data("digits")
    exact = exact_noise_scale(per_example_gradients(trained_mlp("digits", x, y), F.cross_entropy, x, y))[0]
    lines = [f"Exact B_simple {exact:.1f}.", "",
             "| growth_interval | overflowed after the first finite step | without the rule: run average [95%] | holds | the meter now |",
             "|---|---|---|---|---|"]
    for interval in GROWTH_INTERVALS:
        meter, overflowed, settled = scaled_run(interval, steps)
        raw = without_the_rule(meter)
        holds = raw.ci_low <= exact <= raw.ci_high
        now = meter.run_estimate
        said = "withheld" if not now.measured else f"{now.b_simple:.1f}"
        lines.append(f"| {interval} | {overflowed} of {settled} ({overflowed / max(settled, 1):.1%}) | "
                     f"{raw.b_simple:.1f} [{raw.ci_low:.1f}, {raw.ci_high:.1f}] | {'yes' if holds else '**no**'} | {said} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("\n".join(part_one(args.batches)))
    print()
    print("\n".join(part_two(args.steps)))


if __name__ == "__main__":
    main()
