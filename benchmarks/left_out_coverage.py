#!/usr/bin/env python
"""Parameters left out of the per-example norms: do the intervals hold the whole model's exact value?

    python benchmarks/left_out_coverage.py [--streams 20] [--steps 300] [--out benchmarks/RESULTS.md]

Per-example hooks measure layers of supported types, and bare parameters where each example's gradient can be read
at the op that broadcasts them (``per_example/broadcast.py``); a bare parameter used otherwise (a learned
temperature through a clamp, as CLIP's, or a slope through ``F.prelu``) or a layer of another type is left out. Where the rest is at
least ``MIN_COVERAGE`` of the parameters the estimate stands for the whole model, and its intervals make room for
what the left-out parameters' share of the step gradient allows (``gns_callback/left_out.py``). For each model
below, held at fixed parameters on the digits, the exact ``B_simple`` of the whole model and of the measured
parameters (``gns_callback.exact``), then ``--streams`` plain-loop meters at their defaults over ``--steps`` batches
of 32 drawn with replacement. Reported:
how often the run average's and the recent estimate's 95% intervals hold the whole model's exact value, and their
median width (high/low), with the widening ("now") and without it ("before": the same meter's summed parts read as
they were before the widening existed).
"""

from __future__ import annotations

import argparse
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
from benchmarks.sketch_accuracy import digits  # noqa: E402
from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from gns_callback.smoothing import summarize_ratio  # noqa: E402
from tests.trust.models import ScaledLogits  # noqa: E402

HEADING = "## Parameters left out of the per-example norms: interval coverage (written by the script)"
BATCH = 32


class BareSlope(nn.Module):
    """``nn.PReLU``'s computation on a bare slope, ``F.prelu(x, a)``: left out (``nn.PReLU`` itself is measured
    since 2026-11-28; this model, and its rows in RESULTS.md, were ``nn.PReLU`` before, the same computation)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.weight)


def prelu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), BareSlope(), nn.Linear(32, 10))


def trained(build: Callable[[], nn.Module], steps: int) -> Callable[[], nn.Module]:
    """``build`` then ``steps`` SGD steps (lr 0.1, batch 32, seeded) on the digits."""
    def make() -> nn.Module:
        model, (x, y) = build(), digits()
        optimizer, generator = torch.optim.SGD(model.parameters(), lr=0.1), torch.Generator().manual_seed(1)
        for _ in range(steps):
            index = torch.randint(len(x), (BATCH,), generator=generator)
            optimizer.zero_grad()
            F.cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()
        return model
    return make


MODELS: dict[str, Callable[[], nn.Module]] = {
    "learned logit scale 0.05 (at initialisation)": lambda: ScaledLogits(0.05),
    "learned logit scale 0.2 (at initialisation)": lambda: ScaledLogits(0.2),
    "learned logit scale 1.5, after 100 SGD steps": trained(lambda: ScaledLogits(1.5), 100),
    "PReLU MLP, after 100 SGD steps": trained(prelu_mlp, 100),
}  # a layer-scale vector was a row here until bare parameters were measured (per_example/broadcast.py)


def exact_values(model: nn.Module) -> tuple[float, float]:
    """``(whole model, measured parameters)`` exact B_simple over all 1797 digits."""
    g = per_example_gradients(model, F.cross_entropy, *digits())
    meter = GradientNoiseScaleMeter(model)
    measured = {id(p) for p in meter.collector.measured_parameters()}
    columns = torch.cat([torch.full((p.numel(),), id(p) in measured) for p in model.parameters() if p.requires_grad])
    return exact_noise_scale(g)[0], exact_noise_scale(g[:, columns])[0]


def measured(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int, steps: int) -> GradientNoiseScaleMeter:
    """The framework-free meter at its defaults after ``steps`` batches of :data:`BATCH` drawn with replacement
    (seeded), the parameters held fixed (no optimizer)."""
    meter = GradientNoiseScaleMeter(model).attach()
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model.zero_grad()
        index = torch.randint(len(x), (BATCH,), generator=generator)
        loss = F.cross_entropy(model(x[index]), y[index])
        loss.backward()
        meter.step(micro_batch_size=BATCH, loss=loss.detach())
    meter.detach()
    return meter


def stream(model: nn.Module, seed: int, steps: int) -> dict[str, tuple[float, float]]:
    """One meter's intervals: ``{"run now": (low, high), "run before": ..., "recent now": ..., "recent before": ...}``
    ("before": the same sums read without the widening)."""
    meter = measured(model, *digits(), seed, steps)
    recent, run = meter.read()
    recent_before = meter.ema.summary_of(meter.ema.packed().tolist(), meter.confidence)
    run_before = summarize_ratio(meter.run.sums.tolist(), meter.confidence)
    return {"run now": (run.ci_low, run.ci_high), "run before": (run_before.ci_low, run_before.ci_high),
            "recent now": (recent.ci_low, recent.ci_high),
            "recent before": (recent_before.ci_low, recent_before.ci_high)}


def run(streams: int, steps: int) -> list[dict]:
    rows = []
    for name, make in MODELS.items():
        model = make()
        whole, measured = exact_values(model)
        intervals = [stream(model, seed, steps) for seed in range(streams)]
        cells = {}
        for key in intervals[0]:
            pairs = [interval[key] for interval in intervals]
            held = sum(low <= whole <= high for low, high in pairs)
            cells[key] = (held, statistics.median(high / low if low > 0 else float("inf") for low, high in pairs))
        rows.append({"name": name, "whole": whole, "measured": measured, "cells": cells})
    return rows


def to_markdown(rows: list[dict], command: str, streams: int, steps: int, seconds: float) -> str:
    keys = ["run before", "run now", "recent before", "recent now"]
    lines = [f"Command: `{command}`; {streams} streams × {steps} steps at batch {BATCH}, the meter at its defaults, "
             f"one thread, {seconds / 60:.1f} min. Each cell: intervals holding the whole model's exact value / "
             "streams, and the median width (high/low).", "",
             "| model | exact, whole model | exact, measured parameters | " + " | ".join(keys) + " |",
             "|---|---|---|" + "---|" * len(keys)]
    for row in rows:
        cells = " | ".join(f"{row['cells'][k][0]}/{streams}, {row['cells'][k][1]:.2f}" for k in keys)
        lines.append(f"| {row['name']} | {row['whole']:.1f} | {row['measured']:.1f} | {cells} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=None, help="write/replace this section of a markdown file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = run(args.streams, args.steps)
    command = " ".join(["python benchmarks/left_out_coverage.py", *(sys.argv[1:] if argv is None else argv)])
    text = to_markdown(rows, command, args.streams, args.steps, time.perf_counter() - start)
    publish_section(text, args.out, HEADING)
    return text


if __name__ == "__main__":
    main()
