"""``micro_batch`` on the CPU: square each large gradient in its hook, or hold it to the end of the pass.

``MicroBatchCollector`` squares the gradients of a step's second and later backward passes a bucket at a time, at
the end of the pass (few multi-tensor kernels: what a GPU wants). On the CPU a held gradient outlives its
accumulation into ``.grad``, so the allocator hands the next layers' gradients fresh memory. Since this benchmark's
change, a CPU gradient of ``CPU_SQUARE_NOW_BYTES`` or more is squared in its hook instead. Both policies, on
``overhead.py``'s three models at ``accumulate_grad_batches=4``:

* **Lightning**: ``Trainer.fit`` without the callback, with it holding every gradient (the policy before), and with
  it at its default; the three interleaved round by round (order reversed on odd rounds), CPU time per optimizer
  step after warm-up, medians pooled over rounds.
* **plain loop**: zero_grad, 4 backward passes, the collector's pop and ``|G_B|²``, the optimizer step; blocks of 8
  steps per policy in a shuffled order, the first 2 of each block dropped.

    python benchmarks/micro_batch_squares.py [--rounds 16] [--models MLP CNN Transformer]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.overhead import ModelSpec, batch_pool, lightning_run, model_specs  # noqa: E402
from gns_callback.collectors import micro_batch  # noqa: E402
from gns_callback.collectors.micro_batch import MicroBatchCollector  # noqa: E402
from gns_callback.norms import squared_norm_sum  # noqa: E402

ACCUMULATE = 4
POLICIES = ("baseline", "held (before)", "large squared at once (default)")


@contextlib.contextmanager
def policy(name: str):
    """The collector as it squares under ``name``: holding every gradient patches the size rule off."""
    original = micro_batch._hot_on_cpu
    if name == "held (before)":
        micro_batch._hot_on_cpu = lambda grad: False
    try:
        yield
    finally:
        micro_batch._hot_on_cpu = original


def lightning_medians(spec: ModelSpec, rounds: int, steps: int, warmup: int) -> dict[str, float]:
    """CPU ms per optimizer step of each policy, interleaved over ``rounds``."""
    template, pool, workdir = spec.build(), batch_pool(spec), tempfile.mkdtemp()
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for r in range(rounds):
        for name in POLICIES if r % 2 == 0 else POLICIES[::-1]:
            method = None if name == "baseline" else "micro_batch"
            with policy(name):
                times[name] += lightning_run(spec, template, pool, method, ACCUMULATE, steps, warmup, workdir,
                                             {"sharpness": False})[1]
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def plain_step(net, passes, collector) -> float:
    start = time.thread_time()
    net.zero_grad(set_to_none=True)
    for x, y in passes:
        (torch.nn.functional.cross_entropy(*_flat(net(x), y)) / len(passes)).backward()
    if collector is not None:
        collector.pop()
        squared_norm_sum([p.grad for p in net.parameters()])
    with torch.no_grad():
        for p in net.parameters():
            p.add_(p.grad, alpha=-1e-9)
    return time.thread_time() - start


def _flat(logits: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return logits.reshape(-1, logits.shape[-1]), y.reshape(-1)


def plain_medians(spec: ModelSpec, blocks: int, per_block: int = 8) -> dict[str, float]:
    """CPU ms per step of each policy in a plain loop, blocks of ``per_block`` steps in a shuffled order."""
    net, order = spec.build(), random.Random(0)
    passes = batch_pool(spec, size=ACCUMULATE)
    collector = MicroBatchCollector(net)
    times: dict[str, list[float]] = {name: [] for name in POLICIES}
    for block in range(blocks):
        for name in order.sample(POLICIES, len(POLICIES)):
            if name != "baseline":
                collector.attach()
            with policy(name):
                for i in range(per_block):
                    seconds = plain_step(net, passes, None if name == "baseline" else collector)
                    if i >= 2 and block >= 1:
                        times[name].append(seconds)
            collector.detach()
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def table(rows: list[tuple[str, str, dict[str, float]]]) -> str:
    lines = ["| model | loop | baseline CPU ms/step | held (before) | large squared at once (default) |",
             "|---|---|---|---|---|"]
    for model, loop, ms in rows:
        base = ms["baseline"]
        cells = [f"{ms[name]:.2f} ({ms[name] / base:.3f}×)" for name in POLICIES[1:]]
        lines.append(f"| {model} | {loop} | {base:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=16, help="interleaved Lightning rounds (plain loop: 3× blocks)")
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per Lightning fit")
    parser.add_argument("--models", nargs="+", default=["MLP", "CNN", "Transformer"])
    parser.add_argument("--quick", action="store_true", help="tiny models, few steps (smoke test)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = []
    for spec in (s for s in model_specs(args.quick) if s.name in args.models):
        rows.append((spec.name, "Lightning", lightning_medians(spec, args.rounds, args.steps, warmup=4)))
        rows.append((spec.name, "plain", plain_medians(spec, blocks=3 * args.rounds)))
    text = table(rows)
    print(text)
    return text


if __name__ == "__main__":
    main()
