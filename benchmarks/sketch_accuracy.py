#!/usr/bin/env python
"""Does the sketch of per-example norms cost accuracy? The same meter with sketched and with exact norms, on the
same batch streams of real data, against the exact ``B_simple`` (brute force over every example).

Models, trained briefly with SGD and then frozen, where the sketch replaces the exact norms
(``gns_callback/per_example/sketch.py``):

* ``sequence``: the digits as sequences of 64 pixel tokens, ``Embedding(17, 64)`` then ``Linear(64, 96)`` at every
  position (sketched), mean-pooled, ``Linear(96, 10)``;
* ``transformer``: the same tokens with learned positions through one ``nn.TransformerEncoderLayer`` (width 64,
  4 heads, feed-forward 256: attention projections and feed-forward layers sketched);
* ``conv``: the digits as 8×8 images, ``Conv2d(1, 16)`` then ``Conv2d(16, 48)`` (sketched) with GroupNorm, a global
  average pool (which makes each example's gradient of the second convolution nearly rank one, the sketch's worst
  case) and ``Linear(48, 10)``.

Each stream is ``--steps`` batches of 32 drawn with replacement; both meters read the same batches (the sketch has
its own generator). Reported: mean |run average / exact − 1| ± its standard error, the paired difference, and how
often the 95% interval holds the exact value.

    python benchmarks/sketch_accuracy.py                 # 24 streams × 150 steps per model, a few CPU-minutes
    python benchmarks/sketch_accuracy.py --quick         # 2 streams × 20 steps (smoke test)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import time
from typing import ContextManager, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sklearn.datasets import load_digits  # noqa: E402

from benchmarks.accuracy_peers import BATCH, train_sgd  # noqa: E402
from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from gns_callback.per_example import linear  # noqa: E402



class PixelSequence(nn.Module):
    """The digits as sequences of 64 pixel tokens through a 64 → 96 layer at every position (sketched)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 64)
        self.mix = nn.Linear(64, 96)
        self.head = nn.Linear(96, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))).mean(dim=1))


class PixelTransformer(nn.Module):
    """The digits as 64 pixel tokens with learned positions through one ``nn.TransformerEncoderLayer`` (width 64, 4
    heads, feed-forward 256: its attention projections and both feed-forward layers are sketched), mean-pooled."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(17, 64)
        self.position = nn.Embedding(64, 64)
        self.encoder = nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.head(self.encoder(self.embed(tokens) + self.position(positions)).mean(dim=1))


def pooled_cnn() -> nn.Module:
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.Tanh(),
                         nn.Conv2d(16, 48, 3, padding=1), nn.GroupNorm(4, 48), nn.Tanh(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(48, 10))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


CASES = {"sequence": (PixelSequence, lambda x: (x * 16).round().long()),
         "transformer": (PixelTransformer, lambda x: (x * 16).round().long()),
         "conv": (pooled_cnn, lambda x: x)}


def train(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """Plain SGD at lr 0.5 (batches of 32, draws seeded 1), as :func:`benchmarks.accuracy_peers.train_sgd`."""
    train_sgd(model, x, y, steps, lr=0.5, seed=1)


def stream_estimates(model: nn.Module, x: torch.Tensor, y: torch.Tensor, streams: int, steps: int) -> list:
    """The meter's run average after ``steps`` batches, per stream (stream ``s`` draws its batches from seed
    ``100 + s``)."""
    estimates = []
    for stream in range(streams):
        generator = torch.Generator().manual_seed(100 + stream)
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(steps):
                index = torch.randint(0, x.shape[0], (BATCH,), generator=generator)
                model.zero_grad()
                F.cross_entropy(model(x[index]), y[index]).backward()
                meter.step()
            estimates.append(meter.run_estimate)
    return estimates


@contextlib.contextmanager
def sketch_rule(margin: float, extra_launches: Optional[float] = None) -> Iterator[None]:
    """Within it, :func:`~gns_callback.per_example.linear.sequence_norm_choice` sketches where the sketch is
    ``margin`` times cheaper than the exact forms, with its extra kernel launches counted ``extra_launches`` times
    (None: as the package counts them)."""
    saved = linear.SKETCH_MARGIN, linear.SKETCH_EXTRA_LAUNCHES
    linear.SKETCH_MARGIN = margin
    linear.SKETCH_EXTRA_LAUNCHES = saved[1] if extra_launches is None else extra_launches
    try:
        yield
    finally:
        linear.SKETCH_MARGIN, linear.SKETCH_EXTRA_LAUNCHES = saved


def exact_norms_only() -> ContextManager[None]:
    """Within it, per-example norms are never sketched (``SKETCH_MARGIN`` is infinite)."""
    return sketch_rule(math.inf)


def sketches_only() -> ContextManager[None]:
    """Within it, sequence and im2col norms are sketched wherever a sketch is any cheaper in arithmetic, on any
    device (no margin, its launches not counted)."""
    return sketch_rule(1e-9, extra_launches=0)


def evaluate(name: str, streams: int, steps: int, train_steps: int) -> list[str]:
    make, inputs = CASES[name]
    x, y = digits()
    x = inputs(x)
    torch.manual_seed(0)
    model = make()
    train(model, x, y, train_steps)
    exact = exact_noise_scale(per_example_gradients(model, F.cross_entropy, x, y))[0]
    sketched = stream_estimates(model, x, y, streams, steps)
    with exact_norms_only():
        exact_norms = stream_estimates(model, x, y, streams, steps)
    rows = []
    errors = {}
    for label, estimates in (("sketched (the default)", sketched), ("exact norms", exact_norms)):
        err = np.array([abs(e.b_simple / exact - 1) for e in estimates])
        errors[label] = err
        covered = sum(e.ci_low <= exact <= e.ci_high for e in estimates)
        rows.append(f"| {name} | {exact:.1f} | {label} | {err.mean():.4f} ± {err.std(ddof=1) / math.sqrt(streams):.4f}"
                    f" | {covered}/{streams} |")
    diff = errors["sketched (the default)"] - errors["exact norms"]
    rows.append(f"| {name} | | paired difference, sketched − exact | {diff.mean():+.4f} ± "
                f"{diff.std(ddof=1) / math.sqrt(streams):.4f} | |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=24)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--train-steps", type=int, default=150)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    streams, steps = (2, 20) if args.quick else (args.streams, args.steps)
    start = time.time()
    lines = ["| model | exact B_simple | norms | mean \\|rel err\\| of the run average | interval holds exact |",
             "|---|---|---|---|---|"]
    for name in CASES:
        lines += evaluate(name, streams, steps, args.train_steps)
    print(f"`python benchmarks/sketch_accuracy.py` — {platform.machine()}, torch {torch.__version__}, one thread, "
          f"{streams} streams × {steps} steps per model, {(time.time() - start) / 60:.1f} min\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
