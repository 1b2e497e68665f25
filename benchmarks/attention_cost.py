"""Cost of per-example norms on PyTorch's own attention: a pre-LN ``nn.TransformerEncoderLayer`` (d_model 128,
4 heads, MLP 512, batch 32, 64 positions, an LM head of 512), the shape of ``overhead.py``'s transformer block but
with ``nn.MultiheadAttention`` instead of Linear q/k/v. Plain loop, one thread, baseline and
:class:`~gns_callback.per_example.PerExampleNormTracker` (every example) on copies of one model, alternating step by
step (which goes first alternates too); CPU time (``time.thread_time``) of zero_grad + forward + backward (+ pop).

    python benchmarks/attention_cost.py [--steps 60]
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

from gns_callback.per_example import PerExampleNormTracker  # noqa: E402

BATCH, LENGTH, WIDTH, VOCAB = 32, 64, 128, 512


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True,
                                                    norm_first=True), nn.Linear(WIDTH, VOCAB))


def timed_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, tracker=None) -> float:
    start = time.thread_time()
    model.zero_grad(set_to_none=True)
    logits = model(x)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    if tracker is not None:
        tracker.pop()
    return time.thread_time() - start


def compare(make_model, x: torch.Tensor, y: torch.Tensor, steps: int) -> str:
    """Baseline and tracker on two copies of ``make_model()``, alternating step by step after 10 warm-up steps."""
    torch.set_num_threads(1)
    base, hooked = make_model(), make_model()
    tracker = PerExampleNormTracker(hooked, max_examples=None).attach()
    tracker.expected_batch_size = x.shape[0]
    plain, measured = [], []
    for i in range(steps + 10):
        pair = [(plain, lambda: timed_step(base, x, y)), (measured, lambda: timed_step(hooked, x, y, tracker))]
        for times, run in (pair if i % 2 else pair[::-1]):
            elapsed = run()
            if i >= 10:
                times.append(elapsed)
    ratio = statistics.median(measured) / statistics.median(plain)
    return (f"coverage {tracker.coverage_fraction():.0%}; baseline {statistics.median(plain) * 1e3:.2f} ms, tracker "
            f"{statistics.median(measured) * 1e3:.2f} ms (medians of {steps}): {ratio:.2f}×; ratio of means "
            f"{sum(measured) / sum(plain):.2f}×")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each (after 10 warm-up)")
    args = parser.parse_args(argv)
    x, y = torch.randn(BATCH, LENGTH, WIDTH), torch.randint(0, VOCAB, (BATCH, LENGTH))
    print(compare(make, x, y, args.steps))


if __name__ == "__main__":
    main()
