#!/usr/bin/env python
"""Where the CNN's per-example conv norms spend their time on a device, path by path, and in ``Trainer.fit``.

    python benchmarks/gpu_conv_paths.py --json conv_paths.json     # on the GPU machine (~2 min)
    python benchmarks/gpu_conv_paths.py --layers-only --device cpu # the per-layer table on this machine
    python benchmarks/gpu_conv_paths.py --large --json large.json   # ResNet-sized layers, per layer only

Part 1, per layer: the three convolutions of ``benchmarks/overhead.py``'s CNN at batch 64, each path of
``gns_callback/per_example/conv.py`` timed alone (median of 7 repeats of 20 calls; on CUDA by events around the
20 calls, so a path bound by its launches shows its launch time): the layer's own weight gradient for scale;
exact norms by the grouped weight-gradient convolution; the grouped convolution's sketch; im2col with the exact
form and with the sketch; and the path the package picks (the cost model's method by arithmetic alone, and with the
sketch's extra kernel launches counted on an accelerator, ``gns_callback/per_example/launches.py``).

Part 2, in ``Trainer.fit`` on CUDA (``benchmarks/gpu_overhead.py``'s timing: CUDA events at each optimizer step,
no sync during the fit; interleaved rounds): the CNN with ``per_example`` at its defaults, with every conv norm
exact (no sketch), and with every conv through im2col, each over the plain step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.sketch_accuracy import exact_norms_only, sketches_only  # noqa: E402
from gns_callback.per_example import conv, linear  # noqa: E402
from gns_callback.per_example.launches import launch_cost_per_example  # noqa: E402

BATCH = 64
#: The CNN of benchmarks/overhead.py: (layer, input shape) at batch 64.
LAYERS = [(lambda: nn.Conv2d(3, 32, 3, padding=1), (BATCH, 3, 32, 32)),
          (lambda: nn.Conv2d(32, 64, 3, stride=2, padding=1), (BATCH, 32, 32, 32)),
          (lambda: nn.Conv2d(64, 64, 3, stride=2, padding=1), (BATCH, 64, 16, 16))]
#: Layers the device, not the host, is the bottleneck of: a ResNet's stem and stages at 224×224, batch 64.
LARGE_LAYERS = [(lambda: nn.Conv2d(3, 64, 7, stride=2, padding=3), (BATCH, 3, 224, 224)),
                (lambda: nn.Conv2d(64, 64, 3, padding=1), (BATCH, 64, 56, 56)),
                (lambda: nn.Conv2d(128, 128, 3, padding=1), (BATCH, 128, 28, 28)),
                (lambda: nn.Conv2d(256, 256, 3, padding=1), (BATCH, 256, 14, 14)),
                (lambda: nn.Conv2d(512, 512, 3, padding=1), (BATCH, 512, 7, 7))]
#: Sequence layers, (batch, positions, in, out): GPT-2 small's MLP and attention projections at sequence 512, and
#: benchmarks/overhead.py's transformer block's MLP.
SEQUENCE_LAYERS = [(8, 512, 768, 3072), (8, 512, 768, 768), (32, 64, 128, 512)]


def timed_ms(call: Callable[[], object], device: torch.device, calls: int = 20, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` calls (CUDA events on a GPU, CPU time on the CPU)."""
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            begin = time.thread_time()
            for _ in range(calls):
                call()
            times.append(1000 * (time.thread_time() - begin) / calls)
    return statistics.median(times)


def layer_paths(module: nn.Conv2d, x: torch.Tensor, grad: torch.Tensor) -> dict[str, Callable[[], object]]:
    batch = x.shape[0]
    return {
        "own weight gradient": lambda: torch.nn.grad.conv2d_weight(x, module.weight.shape, grad, stride=module.stride,
                                                                   padding=module.padding),
        "grouped conv, exact": lambda: conv.per_example_weight_grads(module, x, grad).reshape(batch, -1)
        .square_().sum(1),
        "grouped conv, sketch": lambda: conv._sketched_weight_sq_norms(module, x, grad),
        "im2col, exact": lambda: _within(exact_norms_only, conv.im2col_weight_sq_norms, module, x, grad),
        "im2col, sketch": lambda: _within(sketches_only, conv.im2col_weight_sq_norms, module, x, grad),
        "package's pick": lambda: conv.conv_weight_sq_norms(module, x, grad),
    }


@contextlib.contextmanager
def im2col_only() -> Iterator[None]:
    """Within it every convolution goes through im2col (no grouped weight-gradient convolution)."""
    threshold, conv._GROUPED_CONV_MIN_CHANNELS = conv._GROUPED_CONV_MIN_CHANNELS, 10**9
    try:
        yield
    finally:
        conv._GROUPED_CONV_MIN_CHANNELS = threshold


def layer_table(device: torch.device, layers=LAYERS) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    for make, shape in layers:
        module = make().to(device)
        x = torch.randn(*shape, device=device)
        grad = torch.randn_like(module(x))
        times = {name: timed_ms(call, device) for name, call in layer_paths(module, x, grad).items()}
        positions = grad[0, 0].numel()
        sizes = (positions, module.weight[0].numel(), module.out_channels)
        rows.append({"layer": f"Conv2d {module.in_channels}→{module.out_channels} s{module.stride[0]} "
                              f"{shape[2]}×{shape[3]} ({shape[0]})", "cost model": conv.sequence_norm_method(*sizes),
                     "on this device": conv.sequence_norm_method(*sizes, launch_cost_per_example(device, shape[0])),
                     "ms": times})
    return rows


def sequence_table(device: torch.device) -> list[dict]:
    """``sequence_sq_norms`` on each of :data:`SEQUENCE_LAYERS`: exact (Gram or materialised, as the shapes pick),
    sketched, and the package's pick."""
    torch.manual_seed(0)
    rows = []
    for batch, positions, k, l in SEQUENCE_LAYERS:
        a, d = torch.randn(batch, positions, k, device=device), torch.randn(batch, positions, l, device=device)
        calls = {"weight gradient": lambda: a.reshape(-1, k).t() @ d.reshape(-1, l),
                 "exact": lambda: _within(exact_norms_only, linear.sequence_sq_norms, a, d),
                 "sketch": lambda: _within(sketches_only, linear.sequence_sq_norms, a, d),
                 "package's pick": lambda: linear.sequence_sq_norms(a, d)}
        rows.append({"layer": f"Linear {k}→{l} over {positions} positions ({batch})",
                     "cost model": linear.sequence_norm_method(positions, k, l),
                     "on this device": linear.sequence_norm_method(positions, k, l,
                                                                   launch_cost_per_example(device, batch)),
                     "ms": {name: timed_ms(call, device) for name, call in calls.items()}})
    return rows


def _within(context, function, *args):
    with context():
        return function(*args)


#: Part 2's arms: (key, label, context the fit runs in).
ARMS = {"default": ("per_example at its defaults", contextlib.nullcontext),
        "exact": ("per_example, conv norms exact (no sketch)", exact_norms_only),
        "im2col": ("per_example, every conv through im2col", im2col_only)}


def fit_table(rounds: int, steps: int, warmup: int, log=print) -> list[dict]:
    from benchmarks import gpu_overhead
    from benchmarks.overhead import _quiet, model_specs

    _quiet()
    spec = next(s for s in model_specs(quick=False) if s.name == "CNN")
    original_fit = gpu_overhead.fit

    def fit_in_arm(spec_, template, pool, method, accumulate, run_steps, warm, workdir, kwargs):
        kwargs = dict(kwargs)
        arm = kwargs.pop("arm", "default")
        with ARMS[arm][1]():
            return original_fit(spec_, template, pool, method, accumulate, run_steps, warm, workdir, kwargs)

    configs = [("base_acc1", "baseline", None, 1, None, {})]
    configs += [(key, label, "per_example", 1, "base_acc1", {"arm": key}) for key, (label, _) in ARMS.items()]
    gpu_overhead.fit = fit_in_arm
    try:
        with tempfile.TemporaryDirectory(prefix="gns_conv_paths_") as workdir:
            return gpu_overhead.measure_model(spec, configs, rounds, steps, warmup, workdir, log)
    finally:
        gpu_overhead.fit = original_fit


def layer_lines(rows: list[dict]) -> list[str]:
    names = list(rows[0]["ms"])
    lines = ["| layer (batch) | arithmetic alone picks | with launches picks | " + " | ".join(names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for row in rows:
        device_pick = row.get("on this device", "(not recorded)")  # runs before the launches counted
        lines.append(f"| {row['layer']} | {row['cost model']} | {device_pick} | "
                     + " | ".join(f"{row['ms'][n]:.3f}" for n in names) + " |")
    return lines


def render(result: dict) -> str:
    lines = [f"- Command: `{result['command']}`", f"- Device: {result['device']}; torch {result['torch']}", ""]
    lines += layer_lines(result["layers"])
    if result.get("sequences"):
        lines += [""] + layer_lines(result["sequences"])
    if result.get("fit"):
        lines += ["", "| CNN configuration | step (GPU timeline) | host step | ratio | per-round ratios |",
                  "|---|---|---|---|---|"]
        for row in result["fit"]:
            ratio = f"**{row['ratio']:.3f}×**" if "ratio" in row else "—"
            rounds = ", ".join(f"{r:.3f}" for r in row.get("round_ratios", []))
            lines.append(f"| {row['label']} | {row['median_ms']:.3f} ms | {row['host_median_ms']:.3f} ms | {ratio} "
                         f"| {rounds} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers-only", action="store_true")
    parser.add_argument("--large", action="store_true", help="time ResNet-sized layers (224×224) instead of the "
                        "CNN's; no fit (implies --layers-only)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--from-json", type=Path, help="no measuring: render a saved --json file")
    args = parser.parse_args(argv)
    if args.from_json:
        print(render(json.loads(args.from_json.read_text())))
        return 0
    device = torch.device(args.device)
    command = "python benchmarks/gpu_conv_paths.py " + " ".join(sys.argv[1:] if argv is None else argv)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU, one thread"
    if device.type == "cpu":
        torch.set_num_threads(1)
    layers = layer_table(device, LARGE_LAYERS if args.large else LAYERS)
    result = {"command": command, "device": name, "torch": torch.__version__, "layers": layers}
    if args.large:
        result["sequences"] = sequence_table(device)
    print(render(result), flush=True)
    if not (args.layers_only or args.large):
        result["fit"] = fit_table(args.rounds, args.steps, args.warmup)
        print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
