"""Cost of measuring weights written out as matrix products (``x @ W + b``: :mod:`gns_callback.per_example.matmul`)
per example, against the same layers as ``nn.Linear`` (:mod:`gns_callback.per_example.linear`), on
``benchmarks/overhead.py``'s MLP (784-512-512-10, batch 128) and a transformer block of its shape (64 positions,
width 128, feed-forward 512, one head, batch 32) written both ways. Plain loop, one thread, four models stepped in
turn (the order rotating): each form without and with the tracker; CPU time (``time.thread_time``) of zero_grad +
forward + backward (+ pop), every example measured.

    python benchmarks/matmul_cost.py [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.broadcast_cost import timed_step  # noqa: E402
from gns_callback.per_example import PerExampleNormTracker  # noqa: E402


class Dense(nn.Module):
    """``x @ W + b`` with bare parameters, or the ``nn.Linear`` it equals."""

    def __init__(self, fan_in: int, fan_out: int, bare: bool) -> None:
        super().__init__()
        self.linear = None if bare else nn.Linear(fan_in, fan_out)
        if bare:
            self.weight = nn.Parameter(torch.randn(fan_in, fan_out) / fan_in**0.5)
            self.bias = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) if self.linear is not None else x @ self.weight + self.bias


class Mlp(nn.Module):
    def __init__(self, bare: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Dense(784, 512, bare), Dense(512, 512, bare), Dense(512, 10, bare)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class Block(nn.Module):
    """Token embedding, one head of self-attention and a feed-forward layer, each projection a :class:`Dense`."""

    def __init__(self, bare: bool, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.query, self.key, self.value, self.out = (Dense(dim, dim, bare) for _ in range(4))
        self.up, self.down, self.head = Dense(dim, 4 * dim, bare), Dense(4 * dim, dim, bare), Dense(dim, 10, bare)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        scores = self.query(h) @ self.key(h).transpose(1, 2) / h.shape[-1] ** 0.5
        h = h + self.out(scores.softmax(-1) @ self.value(h))
        return self.head((h + self.down(F.gelu(self.up(h)))).mean(1))


CASES = {"MLP 784-512-512-10, batch 128": (Mlp, lambda: torch.randn(128, 784), 128),
         "transformer block, 64 positions, batch 32": (Block, lambda: torch.randint(0, 256, (32, 64)), 32)}


def tracked(model: nn.Module, batch: int) -> PerExampleNormTracker:
    tracker = PerExampleNormTracker(model, max_examples=None).attach()
    tracker.expected_batch_size = batch
    return tracker


def run(name: str, steps: int) -> str:
    make, inputs, batch = CASES[name]
    torch.manual_seed(0)
    x, y = inputs(), torch.randint(0, 10, (batch,))
    models = [make(bare) for bare in (True, True, False, False)]
    trackers = [None, tracked(models[1], batch), None, tracked(models[3], batch)]
    times: list[list[float]] = [[], [], [], []]
    for i in range(steps + 5):
        for k in [(i + j) % 4 for j in range(4)]:
            elapsed = timed_step(models[k], x, y, trackers[k])
            if i >= 5:
                times[k].append(elapsed)
    bare, bare_tracked, linear, linear_tracked = (statistics.median(t) * 1e3 for t in times)
    return (f"| {name} | {bare:.2f} ms | {bare_tracked:.2f} ms ({bare_tracked / bare:.2f}×; coverage "
            f"{trackers[1].coverage_fraction():.0%}) | {linear:.2f} ms | {linear_tracked:.2f} ms "
            f"({linear_tracked / linear:.2f}×) |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each (after 5 warm-up)")
    steps = parser.parse_args(argv).steps
    torch.set_num_threads(1)
    print("| model | `x @ W + b`, plain | with the tracker | `nn.Linear`, plain | with the tracker |\n"
          "|---|---|---|---|---|")
    for name in CASES:
        print(run(name, steps), flush=True)


if __name__ == "__main__":
    main()
