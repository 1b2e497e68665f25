#!/usr/bin/env python
"""Per-example norm cost of the working tree against an earlier revision, interleaved in one process.

    python benchmarks/per_example_speedup.py --against 1461142 [--models CNN] [--steps 30] [--quick]

The layer functions (``gns_callback/per_example/{linear,conv,embedding,normalization,sketch}.py``) of
``--against`` are read with ``git show`` into a temporary package; the tracker (hooks, glue) is the working tree's for both. Per
model of ``benchmarks/overhead.py`` (full size, all examples, one thread), three plain-loop steps alternate,
their order rotating every step: baseline (no hooks), tracker with the old layer functions, tracker with the new
ones. Reported: median CPU time (``time.thread_time``) per step, ratios to the baseline, and the largest relative
difference of the per-example squared norms old vs new on one batch (float rounding only).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.overhead import GnsTrackerStep, PlainStep, batch_pool, model_specs, set_threads  # noqa: E402
from gns_callback.per_example import tracker as tracker_module  # noqa: E402

LAYER_FILES = ("linear", "conv", "conv_transpose", "embedding", "normalization", "sketch", "launches")


def load_old_functions(revision: str, workdir: Path) -> dict[type, object]:
    """``SUPPORTED_MODULES`` as it maps onto the layer functions of ``revision`` (the types it had functions for)."""
    package = workdir / "old_per_example"
    package.mkdir()
    (package / "__init__.py").write_text("")
    present = []
    for name in LAYER_FILES:
        shown = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:gns_callback/per_example/{name}.py"],
                               capture_output=True, text=True)
        if shown.returncode == 0:  # a helper a revision may not have yet (sketch.py before 6ec8cfd, launches.py)
            (package / f"{name}.py").write_text(shown.stdout)
            present.append(name)
    spec = importlib.util.spec_from_file_location("old_per_example", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    sys.modules["old_per_example"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["old_per_example"])
    modules = {name: importlib.import_module(f"old_per_example.{name}") for name in present}
    found = {cls: next((getattr(m, fn.__name__) for m in modules.values() if hasattr(m, fn.__name__)), None)
             for cls, fn in tracker_module.SUPPORTED_MODULES.items()}
    return {cls: fn for cls, fn in found.items() if fn is not None}


def with_functions(step: GnsTrackerStep, functions: dict[type, object]) -> GnsTrackerStep:
    tracker = step.tracker
    for module, covered in list(tracker._covered_modules.items()):
        tracker._covered_modules[module] = dataclasses.replace(covered, sq_norms=functions[type(module)])
    return step


def run(revision: str, models: list[str] | None, steps: int, warmup: int, quick: bool = False) -> str:
    set_threads(1)
    lines = [f"| model | batch | baseline CPU ms | layer functions at {revision}: ms (ratio) "
             "| working tree: ms (ratio) | old/new extra time | max rel. diff old vs new |",
             "|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old_functions(revision, Path(tmp))
        for spec in model_specs(quick=quick):
            if models and spec.name.lower() not in {m.lower() for m in models}:
                continue
            torch.manual_seed(0)
            template = spec.build()
            pool = batch_pool(spec)
            variants = {
                "base": PlainStep(spec, copy.deepcopy(template)),
                "old": with_functions(GnsTrackerStep(spec, copy.deepcopy(template)), old),
                "new": GnsTrackerStep(spec, copy.deepcopy(template)),
            }
            x, y = pool[0]
            sq = {k: variants[k](x, y) for k in ("base", "old", "new")}  # same start, same batch: first warm-up step
            rel = ((sq["old"] - sq["new"]).abs() / sq["new"].abs().clamp_min(1e-30)).max().item()
            times: dict[str, list[float]] = {k: [] for k in variants}
            order = list(variants)
            for i in range(warmup + steps * spec.step_factor):
                x, y = pool[i % len(pool)]
                for key in order[i % 3:] + order[: i % 3]:
                    start = time.thread_time()
                    variants[key](x, y)
                    if i >= warmup:
                        times[key].append(time.thread_time() - start)
            ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
            extra = (ms["old"] - ms["base"]) / max(ms["new"] - ms["base"], 1e-9)
            ratio = {k: ms[k] / ms["base"] for k in ("old", "new")}
            lines.append(f"| {spec.name} | {spec.batch} | {ms['base']:.2f} | {ms['old']:.2f} ({ratio['old']:.2f}×) "
                         f"| {ms['new']:.2f} ({ratio['new']:.2f}×) | {extra:.2f} | {rel:.1e} |")
            for step in variants.values():
                step.close()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="1461142", help="git revision whose layer functions are compared")
    parser.add_argument("--models", nargs="+", help="subset of MLP CNN Transformer")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (x3 for the MLP)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny models (smoke test)")
    args = parser.parse_args()
    print(run(args.against, args.models, args.steps, args.warmup, quick=args.quick))


if __name__ == "__main__":
    main()
