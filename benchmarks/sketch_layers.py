#!/usr/bin/env python
"""Per-layer cost of the per-example norms, exact against sketched, with the layer's own weight gradient for scale.

    python benchmarks/sketch_layers.py            # one thread, CPU time per call (ms), medians of 30 calls

Shapes: the transformer block's projections of ``benchmarks/overhead.py`` (batch 32, 64 positions), a wider and
longer layer, and the CNN's two stride-2 convolutions (batch 64). "exact" is the form the package would take
without the sketch (Gram form or materialised for a Linear, the grouped weight-gradient convolution for a conv);
"sketch" is ``gns_callback/per_example/sketch.py``. Last row: the random signs of one such layer's probes.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sketch_accuracy import exact_norms_only  # noqa: E402
from gns_callback.per_example import conv, linear  # noqa: E402
from gns_callback.per_example.sketch import PROBES, probe_signs, sketched_sq_norms  # noqa: E402

LINEAR_SHAPES = [(32, 64, 128, 512), (32, 64, 128, 128), (32, 256, 256, 256)]  # (batch, positions, in, out)
CONV_CASES = [(nn.Conv2d(32, 64, 3, stride=2, padding=1), (64, 32, 32, 32)),
              (nn.Conv2d(64, 64, 3, stride=2, padding=1), (64, 64, 16, 16))]


def cpu_ms(call: Callable[[], object], repeats: int = 30) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        call()
        times.append(time.thread_time() - start)
    return 1000 * statistics.median(times)


def exact_sequence(a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The exact form ``sequence_sq_norms`` takes when the sketch is ruled out."""
    with exact_norms_only():
        return linear.sequence_sq_norms(a, d)


def linear_row(batch: int, positions: int, k: int, l: int) -> str:
    a, d = torch.randn(batch, positions, k), torch.randn(batch, positions, l)
    weight_grad = cpu_ms(lambda: a.reshape(-1, k).t() @ d.reshape(-1, l))
    form = "Gram" if linear.prefers_gram(positions, k, l) else "materialised"
    return (f"| Linear {k} → {l} over {positions} positions ({batch}) | {weight_grad:.2f} | "
            f"{cpu_ms(lambda: exact_sequence(a, d)):.2f} ({form}) | {cpu_ms(lambda: sketched_sq_norms(a, d)):.2f} |")


def conv_row(module: nn.Conv2d, shape: tuple[int, ...]) -> str:
    x = torch.randn(*shape)
    grad = torch.randn_like(module(x))
    batch = shape[0]
    weight_grad = cpu_ms(lambda: torch.nn.grad.conv2d_weight(x, module.weight.shape, grad, stride=module.stride,
                                                              padding=module.padding))
    exact = cpu_ms(lambda: conv.per_example_weight_grads(module, x, grad).reshape(batch, -1).square_().sum(1))
    sketch = cpu_ms(lambda: conv._sketched_weight_sq_norms(module, x, grad))
    return (f"| Conv2d {module.in_channels} → {module.out_channels}, s{module.stride[0]}, {shape[2]}×{shape[3]} "
            f"({batch}) | {weight_grad:.2f} | {exact:.2f} (grouped conv) | {sketch:.2f} |")


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("| layer (batch) | weight gradient | exact norms | sketch |")
    print("|---|---|---|---|")
    for shape in LINEAR_SHAPES:
        print(linear_row(*shape))
    for module, shape in CONV_CASES:
        print(conv_row(module, shape))
    signs = cpu_ms(lambda: probe_signs((32, 128, PROBES), torch.device("cpu"), torch.float32))
    print(f"| {32 * 128 * PROBES} random signs (`probe_signs`, the cost model's RANDOM_DRAW_COST) | | | {signs:.3f} |")


if __name__ == "__main__":
    main()
