#!/usr/bin/env python
"""On a CUDA GPU: where the host's time goes in a training step with the meter, by operator (``torch.profiler``).

    python benchmarks/gpu_profile.py > gpu_profile.txt          # on the GPU machine (~30 s)

A plain loop (zero_grad, forward, backward, ``meter.step``, SGD step) of two models of
``benchmarks/gpu_overhead.py`` where the host is the bottleneck: the MLP with ``per_example`` and EfficientNet-B0
with ``micro_batch`` (accumulate 4). Twenty steps are profiled after ten of warm-up, with and without the meter;
the tables list the operators by host (self CPU) time, and the totals say what the meter adds per step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.gpu_overhead import efficientnet_spec  # noqa: E402
from benchmarks.overhead import batch_pool, model_specs  # noqa: E402
from gns_callback import GradientNoiseScaleMeter  # noqa: E402


def loop(spec, net, pool, meter, steps: int, accumulate: int) -> None:
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
    for step in range(steps):
        for k in range(accumulate):
            x, y = pool[(step * accumulate + k) % len(pool)]
            (spec.loss(net(x), y) / accumulate).backward()
        if meter is not None:
            meter.step(micro_batch_size=spec.batch)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def profile(spec, method: str, accumulate: int, rows: int = 14) -> None:
    torch.manual_seed(0)
    net = spec.build().cuda()
    pool = [(x.cuda(), y.cuda()) for x, y in batch_pool(spec)]
    for with_meter in (False, True):
        meter = GradientNoiseScaleMeter(net, method=method).attach() if with_meter else None
        loop(spec, net, pool, meter, 10, accumulate)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            loop(spec, net, pool, meter, 20, accumulate)
            torch.cuda.synchronize()
        wall = (time.perf_counter() - started) / 20 * 1000
        label = f"{spec.name}, {'meter ' + method if with_meter else 'no meter'}, accumulate {accumulate}"
        print(f"\n### {label}: {wall:.2f} ms per step (wall, profiled)\n")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
        if meter is not None:
            meter.detach()


def main() -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    mlp = next(s for s in model_specs(quick=False) if s.name == "MLP")
    profile(mlp, "per_example", 1)
    profile(efficientnet_spec(), "micro_batch", 4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
