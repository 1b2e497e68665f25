#!/usr/bin/env python
"""Host cost of checking that the gradients did not change between backward and the read (gns_callback/grad_watch.py).

    python benchmarks/grad_watch_cost.py     # one thread, µs per mark + check, mean of 20,000

Two parameter lists: the MLP 784-512-512-10 of ``benchmarks/overhead.py`` (6 tensors) and 148 small tensors (as many
as GPT-2 small has). "versions only" is what an accelerator pays on most steps; "versions + norms" adds the two
watched squared norms (every step on the CPU).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback.grad_watch import GradientWatch  # noqa: E402

CALLS = 20_000


def parameter_lists() -> dict[str, list[nn.Parameter]]:
    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    return {"MLP 784-512-512-10": list(mlp.parameters()),
            "148 tensors of 64": [nn.Parameter(torch.randn(64)) for _ in range(148)]}


def microseconds(watch: GradientWatch, norms: bool) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        watch.mark()
        watch.problem(norms=norms)
    return (time.perf_counter() - start) / CALLS * 1e6


def main() -> None:
    torch.set_num_threads(1)
    print("| parameters | tensors | versions only | versions + norms |\n|---|---|---|---|")
    for name, params in parameter_lists().items():
        for p in params:
            p.grad = torch.randn_like(p)
        watch = GradientWatch(params)
        versions, both = microseconds(watch, False), microseconds(watch, True)
        print(f"| {name} | {len(params)} | {versions:.1f} µs | {both:.1f} µs |")


if __name__ == "__main__":
    main()
