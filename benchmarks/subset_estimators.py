#!/usr/bin/env python
"""The two |G|² estimates of a step that measures a subset of its examples, and their blend, on exact gradients.

    python benchmarks/subset_estimators.py [--streams 30] [--steps 300] [--batch 64] [--measured 16]

For each model (the frozen cases of ``benchmarks/accuracy_peers.py`` plus the digits token model of the tests), the
exact per-example gradient of every example is computed once (``gns_callback.exact``); each stream then draws
batches i.i.d. with replacement and, per step, forms from those rows exactly what the meter sees with ``k`` of
``B`` examples measured: the two-batch-size ``|G|²`` (``(B·|G_B|² − m)/(B − 1)``, ``m`` the measured mean square),
the pair estimate (every pair with a measured example, :mod:`gns_callback.accumulation`), every example's
U-statistic, and the blend of the first two (:class:`gns_callback.blend.PairBlend`). Reported: mean
|run-average ratio / exact − 1| over streams (``tr Σ = m − |G|²``, the ratio of sums over steps).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy_peers import CASES, _digits, frozen_model  # noqa: E402
from gns_callback.blend import PairBlend  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from tests.helpers import token_model  # noqa: E402


def cases() -> list[tuple[str, torch.Tensor]]:
    """(name, exact per-example gradient rows) per model."""
    out = []
    for case in CASES[:3]:
        x, y = case.data()
        out.append((case.key, per_example_gradients(frozen_model(case, x, y), F.cross_entropy, x, y)))
    pixels, labels = _digits()
    out.append(("tokens", per_example_gradients(token_model(), F.cross_entropy, (pixels * 16).round().long(), labels)))
    return out


def pair_grad_sq(big: torch.Tensor, measured_sq_sum: torch.Tensor, unmeasured: torch.Tensor, batch: int,
                 k: int) -> torch.Tensor:
    """The pair estimate of |G|² (every pair with a measured example): |G_B|² less the terms no pair of distinct
    examples with a measured one gives, ``(Σ_measured |g_i|² + |Σ_unmeasured g_i|²)/B²``, rescaled."""
    w2 = 1.0 / batch**2
    return (big - w2 * (measured_sq_sum + unmeasured)) / (1.0 - w2 * (k + (batch - k) ** 2))


def step_estimates(g: torch.Tensor, k: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per step (rows of ``g``: steps × B × P): ``(m, |G|²)`` of each estimator, ``m`` its mean square."""
    batch = g.shape[1]
    sq = g.square().sum(-1)
    big = g.mean(1).square().sum(-1)
    every = sq.mean(1)
    measured = sq[:, :k].mean(1)
    unmeasured = g[:, k:].sum(1).square().sum(-1)
    pairs = pair_grad_sq(big, sq[:, :k].sum(1), unmeasured, batch, k)
    return {"every example": (every, (batch * big - every) / (batch - 1)),
            "two-batch": (measured, (batch * big - measured) / (batch - 1)),
            "pairs": (measured, pairs)}


def stream_errors(rows: torch.Tensor, exact: float, steps: int, batch: int, k: int, seed: int) -> dict[str, float]:
    draws = torch.Generator().manual_seed(seed)
    g = rows[torch.randint(0, rows.shape[0], (steps, batch), generator=draws)]
    parts = step_estimates(g, k)
    blend = PairBlend()
    m, y_two = parts["two-batch"]
    blended = torch.stack([blend.blend(m[t], parts["pairs"][1][t], y_two[t], torch.tensor(True)) for t in range(steps)])
    parts["blend"] = (m, blended)
    return {name: abs(float((mm - yy).sum() / yy.sum()) / exact - 1.0) for name, (mm, yy) in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=30)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--measured", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = ["every example", "two-batch", "pairs", "blend"]
    print(f"batch {args.batch}, {args.measured} measured, {args.streams} streams × {args.steps} steps\n")
    print("| case | exact B_simple | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names))
    for name, rows in cases():
        exact = exact_noise_scale(rows)[0]
        errors = [stream_errors(rows, exact, args.steps, args.batch, args.measured, s) for s in range(args.streams)]
        means = [sum(e[n] for e in errors) / len(errors) for n in names]
        print(f"| {name} | {exact:.1f} | " + " | ".join(f"{v:.3f}" for v in means) + " |", flush=True)


if __name__ == "__main__":
    main()
