"""``micro_batch`` on the CPU, process by process: how much of its step-time ratio is glibc's allocator.

On the CPU the callback's ``micro_batch`` overhead moved by more between fresh processes than between the two ways
of squaring gradients that were tried (hold each one to the end of its backward pass, or square the large ones in
their hooks). This benchmark runs each configuration in fresh processes, several times, with glibc's allocator as
it comes and with its mmap and trim thresholds pinned high (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``:
freed memory then stays in the process instead of going back to the kernel and faulting in again):

* each process: ``Trainer.fit`` without the callback and with it (``sharpness=False``): ``method="micro_batch"`` at
  ``accumulate_grad_batches=4`` or ``"per_example"`` at 1, on one of ``overhead.py``'s models, interleaved over
  ``--rounds`` rounds (order reversed on odd rounds); CPU time per optimizer step after warm-up, medians pooled over
  rounds;
* the parent: ``--processes`` processes per model and allocator setting, alternating the settings.

    python benchmarks/micro_batch_allocator.py [--processes 4] [--rounds 4] [--models MLP Transformer]
        [--methods micro_batch per_example]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.overhead import _quiet, batch_pool, lightning_run, model_specs  # noqa: E402

ACCUMULATE = {"micro_batch": 4, "per_example": 1}  # accumulate_grad_batches for each method
PINNED = {"MALLOC_MMAP_THRESHOLD_": str(2**30), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
SETTINGS = {"glibc as it comes": {}, "mmap and trim thresholds pinned at 1 GiB": PINNED}


def one_process(model: str, method: str, rounds: int, steps: int, quick: bool) -> dict[str, float]:
    """CPU ms per optimizer step, without and with the callback (``method``), interleaved in this process."""
    torch.set_num_threads(1)
    _quiet()
    spec = next(s for s in model_specs(quick) if s.name == model)
    template, pool, workdir = spec.build(), batch_pool(spec), tempfile.mkdtemp()
    times: dict[str, list[float]] = {"baseline": [], "callback": []}
    for r in range(rounds):
        for run in (None, method) if r % 2 == 0 else (method, None):
            times["callback" if run else "baseline"] += lightning_run(
                spec, template, pool, run, ACCUMULATE[method], steps, 4, workdir, {"sharpness": False})[1]
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def in_fresh_process(model: str, method: str, setting: str, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, os.path.abspath(__file__), "--child", model, method, "--rounds", str(args.rounds),
               "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
    env = {**os.environ, **SETTINGS[setting]}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[tuple[str, str, str], list[dict[str, float]]]) -> str:
    lines = ["| model | method (accumulate) | glibc | processes | baseline CPU ms/step (median) | ratio, each process "
             "| median |", "|---|---|---|---|---|---|---|"]
    for (model, method, setting), runs in results.items():
        ratios = [run["callback"] / run["baseline"] for run in runs]
        base = statistics.median(run["baseline"] for run in runs)
        lines.append(f"| {model} | `{method}` ({ACCUMULATE[method]}) | {setting} | {len(runs)} | {base:.2f} | "
                     f"{', '.join(f'{r:.3f}' for r in ratios)} | {statistics.median(ratios):.3f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=4, help="fresh processes per model and allocator setting")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds in each process")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per fit")
    parser.add_argument("--models", nargs="+", default=["MLP", "Transformer"])
    parser.add_argument("--methods", nargs="+", default=["micro_batch", "per_example"])
    parser.add_argument("--quick", action="store_true", help="tiny models (smoke test)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(one_process(*args.child, args.rounds, args.steps, args.quick)))
        return ""
    results: dict[tuple[str, str, str], list[dict[str, float]]] = {
        (m, method, s): [] for m in args.models for method in args.methods for s in SETTINGS}
    for i in range(args.processes):
        for model, method, setting in results:
            if i % 2:  # the other setting first
                setting = next(s for s in SETTINGS if s != setting)
            results[model, method, setting].append(in_fresh_process(model, method, setting, args))
    text = table(results)
    print(text)
    return text


if __name__ == "__main__":
    main()
