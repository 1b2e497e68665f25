#!/usr/bin/env python
"""Per-example cost of the default's choice between every example and a subset with its summed gradient.

    python benchmarks/per_example_subset.py [--steps 30] [--quick]

Per model of ``benchmarks/overhead.py`` (full size, one thread, plain loop), four steps alternate, their order
rotating every step: baseline (no hooks); the tracker at the default ``max_examples=16`` (it measures every example
or 16 plus their summed gradient, whichever its cost model, ``gns_callback/per_example/cost.py``, says is cheaper);
the same with the subset forced; every example (``max_examples=None``). Reported: median CPU time per step
(``time.thread_time``), as ratios to the baseline, and what the default chose.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.overhead import PlainStep, batch_pool, model_specs, set_threads  # noqa: E402
from gns_callback.per_example import PerExampleNormTracker  # noqa: E402
from gns_callback.per_example import tracker as tracker_module  # noqa: E402


class TrackerStep(PlainStep):
    """The plain loop with the tracker's hooks; ``force_subset`` measures ``max_examples`` whatever the cost."""

    def __init__(self, spec, net, max_examples, force_subset: bool = False) -> None:
        super().__init__(spec, net)
        self.tracker = PerExampleNormTracker(net, max_examples=max_examples).attach()
        self.force_subset = force_subset
        self.subset_passes = 0

    def forward_backward(self, x, y):
        original = tracker_module.subset_is_cheaper
        if self.force_subset:
            tracker_module.subset_is_cheaper = lambda *args: True
        try:
            super().forward_backward(x, y)
        finally:
            tracker_module.subset_is_cheaper = original

    def norms(self, batch_size):
        (record,) = self.tracker.pop_passes()
        self.subset_passes += bool(record.subset)
        return record.sq_norms


def measure(spec, steps: int, warmup: int) -> dict[str, float]:
    pool, net = batch_pool(spec), spec.build()
    variants = {"baseline": PlainStep(spec, copy.deepcopy(net)),
                "default (max_examples=16)": TrackerStep(spec, copy.deepcopy(net), 16),
                "16 examples + summed gradient, forced": TrackerStep(spec, copy.deepcopy(net), 16, force_subset=True),
                "every example (max_examples=None)": TrackerStep(spec, copy.deepcopy(net), None)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for step in range(warmup + steps):
        order = order[1:] + order[:1]
        for name in order:
            x, y = pool[step % len(pool)]
            start = time.thread_time()
            variants[name](x, y)
            if step >= warmup:
                times[name].append(time.thread_time() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    chose = "subset" if variants["default (max_examples=16)"].subset_passes else "every example"
    return {"medians": medians, "chose": chose}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny models (smoke test)")
    args = parser.parse_args()
    set_threads(1)
    print("| model | batch | default chose | " + " | ".join(["baseline ms", "default", "subset forced", "every example"])
          + " |\n|---|---|---|---|---|---|---|")
    for spec in model_specs(args.quick):
        result = measure(spec, 3 if args.quick else args.steps, 1 if args.quick else args.warmup)
        m = result["medians"]
        base = m["baseline"]
        ratios = [m[name] / base for name in list(m)[1:]]
        print(f"| {spec.name} | {spec.batch} | {result['chose']} | {base * 1e3:.1f} | "
              + " | ".join(f"{r:.2f}×" for r in ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
