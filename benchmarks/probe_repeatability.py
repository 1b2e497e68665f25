"""Probe repeatability: do 5 probe runs on the same model agree within the noise the probe itself reports?

The model is the quickstart notebook's digits MLP (64-128-128-10, SGD with momentum) at the sizes its table
showed (128, 256, 512). Each configuration runs ``probe_micro_batch`` ``--runs`` times in one process. For
every size the probe reports the median samples/s and its 95% interval; the runs *agree* when every two runs'
intervals overlap (``max(low) ≤ min(high)``): then the probe's own test (:func:`gns_callback.probe.timing.faster`)
never tells one run of a size from another. Also reported: the max/min ratio of the runs' medians, the
step-to-step spread (IQR/median), whether the runs' size rankings (``ProbeResult.faster``) ever contradict
each other, the fastest size each run picks, each run's cost (wall seconds), and how fast the machine itself
was just before each run (a fixed matmul), to tell the probe's noise from the machine's.

Configurations: ``default`` (the probe's defaults: ≥ 6 repeats, up to 100, round-robin, 2 s timing budget) and
``3-steps`` (3 timed steps per size, no budget: what the probe did before; too few repeats for an interval).

    python benchmarks/probe_repeatability.py [--threads 1 2] [--runs 5] [--out benchmarks/RESULTS.md]
    python benchmarks/probe_repeatability.py --quick      # smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import os
import platform
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from sklearn.datasets import load_digits  # noqa: E402

from benchmarks.results import replace_section  # noqa: E402
from gns_callback.probe import ProbeConfig, ProbeResult, probe_micro_batch  # noqa: E402

SIZES = (128, 256, 512)
CONFIGS = {
    "default": ProbeConfig(),
    "3-steps": ProbeConfig(timed_steps=3, max_timed_steps=3, timing_budget_s=0.0),
}
HEADING = "## Probe repeatability (issue: throughput too noisy to act on)"


def digits_mlp() -> tuple[nn.Module, torch.optim.Optimizer, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data[:16], dtype=torch.float32) / 16.0
    y = torch.tensor(data.target[:16])
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), (x, y)


def machine_speed(seconds: float = 0.3) -> float:
    """GFLOP/s of a fixed 256×256 matmul (median over ``seconds``), measured before each run: how fast the
    (shared) machine is at that moment, independently of the probe."""
    a = torch.randn(256, 256)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        a @ a
        times.append(time.perf_counter() - start)
    return 2 * 256**3 / sorted(times)[len(times) // 2] / 1e9


def probe_once(config: ProbeConfig) -> ProbeResult:
    net, optimizer, batch = digits_mlp()
    return probe_micro_batch(net, optimizer, batch, lambda b: F.cross_entropy(net(b[0]), b[1]), config=config,
                             memory_budget_bytes=2**30, max_batch_size=max(SIZES), throughput_sizes=SIZES,
                             progress_bar=False)


def size_stats(results: list[ProbeResult], size: int) -> dict[str, Any]:
    timings = [r.timings[size] for r in results]
    rates = [t.samples_per_s(size) for t in timings]
    intervals = [t.samples_per_s_interval(size) for t in timings]
    known = [i for i in intervals if i is not None]
    overlap = len(known) == len(intervals) and max(lo for lo, _ in known) <= min(hi for _, hi in known)
    bands = [(r * (1 - t.spread / 2), r * (1 + t.spread / 2)) for r, t in zip(rates, timings) if t.spread is not None]
    return {
        "in_spread": len(bands) == len(rates) and all(lo <= r <= hi for lo, hi in bands for r in rates),
        "rates": rates,
        "halfwidths": [t.rel_halfwidth for t in timings],
        "repeats": [t.repeats for t in timings],
        "spread": sorted(t.spread for t in timings if t.spread is not None),
        "ratio": max(rates) / min(rates),
        "agree": overlap if known else None,
    }


def contradictions(results: list[ProbeResult]) -> int:
    """Pairs of sizes that one run ranks one way and another run the other way (beyond each run's noise)."""
    count = 0
    for a, b in itertools.combinations(SIZES, 2):
        answers = {r.faster(a, b) for r in results} - {None}
        count += len(answers) > 1
    return count


QUICK = {"timing_budget_s": 0.1, "timed_steps": 6}


def run_config(name: str, config: ProbeConfig, runs: int) -> dict[str, Any]:
    speeds, results = [], []
    for _ in range(runs):
        speeds.append(machine_speed())
        results.append(probe_once(config))
    return {
        "speeds": speeds,
        "name": name,
        "sizes": {size: size_stats(results, size) for size in SIZES},
        "contradictions": contradictions(results),
        "fastest": [r.fastest_micro_batch for r in results],
        "wall": [r.wall_seconds for r in results],
        "timing": [r.timing_seconds for r in results],
    }


def _rate(rate: float, halfwidth: Any) -> str:
    return f"{rate:,.0f}" + (f" ±{halfwidth:.0%}" if halfwidth is not None else "")


def render(outcomes: list[dict[str, Any]], command: str, load: tuple[str, str], runs: int) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor() or "unknown")
    lines = [
        f"Command: `{command}` ({datetime.date.today()}). Hardware: {os.cpu_count()} CPU cores (`nproc`), {cpu}; "
        f"torch {torch.__version__}; shared machine, load average {load[0]} before and {load[1]} after "
        f"(other jobs share the 2 cores). {runs} runs per configuration, one after the other in one process.",
        "",
        "Samples/s per run: the probe's median and the half-width of its 95% interval (order statistics of the "
        "repeats). *Agree*: every two runs' intervals overlap, so the probe's own test cannot tell the runs "
        "apart (what `ProbeResult.faster` decides on). *Spread*: the step-to-step IQR/median of the runs "
        "(min–max); *in spread*: every run's median lies inside every run's median ± spread/2. *Machine speed*: "
        "a fixed matmul timed just before each run; when it moves, the machine itself changed speed between runs "
        "(e.g. torch threads oversubscribing cores that other jobs also use), which no probe can average away.",
        "",
    ]
    for outcome in outcomes:
        runs_header = " | ".join(f"run {i + 1}" for i in range(runs))
        lines += [f"**{outcome['name']}**", "",
                  f"| size | {runs_header} | max/min | agree | spread | in spread | repeats |",
                  "|---:|" + "---:|" * runs + "---:|:---:|---:|:---:|---:|"]
        for size, s in outcome["sizes"].items():
            cells = " | ".join(_rate(r, h) for r, h in zip(s["rates"], s["halfwidths"]))
            agree = {True: "yes", False: "**no**", None: "no interval"}[s["agree"]]
            spread = f"{s['spread'][0]:.0%}–{s['spread'][-1]:.0%}" if s["spread"] else "–"
            repeats = f"{min(s['repeats'])}–{max(s['repeats'])}"
            in_spread = "yes" if s["in_spread"] else "**no**"
            lines.append(f"| {size} | {cells} | {s['ratio']:.2f} | {agree} | {spread} | {in_spread} | {repeats} |")
        wall = ", ".join(f"{w:.2f}" for w in outcome["wall"])
        timing = ", ".join(f"{t:.2f}" for t in outcome["timing"])
        speeds = ", ".join(f"{v:.1f}" for v in outcome["speeds"])
        rows = outcome["sizes"].values()
        agreed = sum(bool(s["agree"]) for s in rows)
        in_spread = sum(s["in_spread"] for s in rows)
        lines += ["", f"Runs agree (intervals overlap) for {agreed} of {len(rows)} sizes, within the spread for "
                      f"{in_spread} of {len(rows)}. Fastest size per run: {outcome['fastest']}; "
                      "size pairs ranked both ways by different runs: "
                      f"{outcome['contradictions']}. Probe cost per run (wall s): {wall} (timing: {timing}). "
                      f"Machine speed just before each run (256×256 matmul, GFLOP/s): {speeds} "
                      f"(max/min {max(outcome['speeds']) / min(outcome['speeds']):.2f}).", ""]
    return "\n".join(lines).rstrip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch threads; several: one table each")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", help="replace this benchmark's section of a RESULTS.md file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 runs, 0.1 s timing budget, nothing written")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.out = 2, None
        for name, config in CONFIGS.items():
            CONFIGS[name] = dataclasses.replace(config, **{k: min(v, getattr(config, k)) for k, v in QUICK.items()})
    load_before = open("/proc/loadavg").read().split()[0]
    started = time.perf_counter()
    outcomes = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for name in args.configs:
            outcome = run_config(name, CONFIGS[name], args.runs)
            outcomes.append({**outcome, "name": f"{name}, {threads} torch thread(s)"})
    load_after = open("/proc/loadavg").read().split()[0]
    command = "python benchmarks/probe_repeatability.py " + " ".join(sys.argv[1:])
    text = render(outcomes, command.strip(), (load_before, load_after), args.runs)
    print(text)
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.out:
        replace_section(args.out, HEADING, text)


if __name__ == "__main__":
    main()
