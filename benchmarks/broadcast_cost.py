"""Cost of measuring a ViT's bare parameters (class token, position table: :mod:`gns_callback.per_example.broadcast`)
per example, on a ViT (``benchmarks/model_scan.py``'s ``ViTStyle``: 32×32×3 images in 4×4
patches, 65 positions, 2 pre-LN encoder layers, width 128, batch 32). Plain loop, one thread, three copies of one
model stepped in turn (the order rotating): no tracker, the tracker with the bare parameters measured (the
default), and the tracker with them left out (as before they were measured); CPU time (``time.thread_time``) of
zero_grad + forward + backward (+ pop), every example measured.

    python benchmarks/broadcast_cost.py [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.model_scan import ViTStyle  # noqa: E402
from gns_callback.per_example import PerExampleNormTracker  # noqa: E402

BATCH = 32


def make() -> nn.Module:
    torch.manual_seed(0)
    return ViTStyle(dim=128, image=32, patch=4, channels=3, layers=2)


def timed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tracker=None) -> float:
    start = time.thread_time()
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    if tracker is not None:
        tracker.pop()
    return time.thread_time() - start


def tracker_for(model: nn.Module, bare: bool) -> PerExampleNormTracker:
    tracker = PerExampleNormTracker(model, max_examples=None)
    if not bare:
        tracker._bare_hooks = lambda: []  # the bare parameters stay left out
    tracker.attach()
    tracker.expected_batch_size = BATCH
    return tracker


def run(steps: int) -> str:
    torch.set_num_threads(1)
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, 10, (BATCH,))
    models = [make() for _ in range(3)]
    trackers = [None, tracker_for(models[1], bare=True), tracker_for(models[2], bare=False)]
    times: list[list[float]] = [[], [], []]
    for i in range(steps + 10):
        for k in [(i + j) % 3 for j in range(3)]:
            elapsed = timed_step(models[k], x, y, trackers[k])
            if i >= 10:
                times[k].append(elapsed)
    plain, measured, left_out = (statistics.median(t) * 1e3 for t in times)
    return (f"| plain step | tracker, bare parameters measured | tracker, bare parameters left out |\n|---|---|---|\n"
            f"| {plain:.2f} ms | {measured:.2f} ms ({measured / plain:.2f}×; coverage "
            f"{trackers[1].coverage_fraction():.1%}) | {left_out:.2f} ms ({left_out / plain:.2f}×; coverage "
            f"{trackers[2].coverage_fraction():.1%}) |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each (after 10 warm-up)")
    print(run(parser.parse_args(argv).steps))


if __name__ == "__main__":
    main()
