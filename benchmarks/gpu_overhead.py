#!/usr/bin/env python
"""On a CUDA GPU: step-time ratio of ``Trainer.fit`` with ``GradientNoiseScaleCallback`` over without it.

    python benchmarks/gpu_overhead.py --json gpu_overhead.json                # on the GPU machine (~4 min, H100)
    python benchmarks/gpu_overhead.py --from-json gpu_overhead.json --out benchmarks/RESULTS.md

The three models and Lightning configurations of ``benchmarks/overhead.py`` (MLP, CNN with GroupNorm,
transformer block; baseline, ``per_example`` at its defaults, with every example, without the sharpness
monitor; ``micro_batch`` at ``accumulate_grad_batches=4``), plus EfficientNet-B0 at 32×32, batch 64
(``micro_batch`` only: it has BatchNorm). Batches live on the GPU already (no host-to-device copy in the step).

Timing: a CUDA event is recorded on the stream each time ``trainer.global_step`` advances, and read after the
fit (no synchronisation during it), so a step's time is what the GPU's timeline shows, host gaps included: when
the host is the bottleneck (small models) the callback's Python work shows, when the GPU is, its kernels do. The
host's own time per step (``perf_counter``) is recorded beside. Rounds are interleaved (every configuration once
per round, the order reversed on odd rounds); ratios are of medians pooled over rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytorch_lightning as pl  # noqa: E402

from benchmarks.cifar10.model import build_model  # noqa: E402
from benchmarks.gpu_probe_truth import GPT, environment  # noqa: E402
from benchmarks.overhead import (  # noqa: E402
    BenchModule, ModelSpec, _quiet, batch_pool, classification_loss, lightning_configs, lm_loss, model_specs,
)
from benchmarks.results import publish_section  # noqa: E402
from gns_callback import GradientNoiseScaleCallback  # noqa: E402

SECTION_HEADING = "## GPU: overhead of the callback"
#: Configurations run per model beyond the three of benchmarks/overhead.py (all of its configurations): BatchNorm
#: allows only ``micro_batch``; the GPU-bound model runs each method at its defaults.
CONFIGS = {"EfficientNet-B0": ("base_acc4", "micro_batch", "micro_batch_nosharp"),
           "GPT-2 small": ("base_acc1", "per_example", "base_acc4", "micro_batch")}
SLOW_MODELS = {"EfficientNet-B0": 3, "GPT-2 small": 4}  # timed steps divided by this


class EventTimer(pl.Callback):
    """A CUDA event and a host stamp at fit start and each time an optimizer step has completed."""

    def __init__(self) -> None:
        self.events: list[torch.cuda.Event] = []
        self.host: list[float] = []
        self._last_step = -1

    def _stamp(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        self.host.append(time.perf_counter())

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step
        self._stamp()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self._stamp()

    def step_ms(self) -> tuple[list[float], list[float]]:
        """(GPU timeline, host) milliseconds of each optimizer step."""
        torch.cuda.synchronize()
        gpu = [a.elapsed_time(b) for a, b in zip(self.events, self.events[1:])]
        host = [1000 * (b - a) for a, b in zip(self.host, self.host[1:])]
        return gpu, host


def gpt_spec(batch: int = 8, seq: int = 512) -> ModelSpec:
    """GPT-2 small (untied head), sequence 512: a model the GPU, not the host, is the bottleneck of."""
    def make_batch(g: torch.Generator):
        tokens = torch.randint(50257, (batch, seq + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return ModelSpec("GPT-2 small", f"12 layers, d 768, 12 heads, vocab 50257, untied head, seq {seq}, batch {batch}, "
                     "fp32", batch, lambda: GPT(seq=seq, tied=False), make_batch, lm_loss)


def efficientnet_spec() -> ModelSpec:
    def make_batch(g: torch.Generator):
        return torch.randn(64, 3, 32, 32, generator=g), torch.randint(10, (64,), generator=g)

    return ModelSpec("EfficientNet-B0", build_model(10)[1] + ", batch 64", 64, lambda: build_model(10)[0],
                     make_batch, classification_loss)


def fit(spec: ModelSpec, template, pool, method, accumulate, steps, warmup, workdir, kwargs) -> dict[str, Any]:
    total = warmup + steps
    module = BenchModule(copy.deepcopy(template), spec.loss, pool, total * accumulate)
    timer = EventTimer()
    callbacks: list[pl.Callback] = [timer]
    if method is not None:
        callbacks.append(GradientNoiseScaleCallback(method=method, verbose=False,
                                                    report_path=f"{workdir}/gns_{spec.name}_{method}.json", **kwargs))
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, max_steps=total,
                         accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         default_root_dir=workdir)
    trainer.fit(module)
    gpu, host = timer.step_ms()
    return {"gpu": gpu[warmup:], "host": host[warmup:]}


def measure_model(spec: ModelSpec, configs, rounds: int, steps: int, warmup: int, workdir: str, log) -> list[dict]:
    torch.manual_seed(0)
    template = spec.build()
    pool = [(x.cuda(), y.cuda()) for x, y in batch_pool(spec)]
    rows = {key: {"model": spec.name, "key": key, "label": label, "baseline": base, "gpu": [], "host": [],
                  "round_medians": []} for key, label, _, _, base, _ in configs}
    for r in range(rounds):
        for key, _, method, accumulate, _, kwargs in (configs if r % 2 == 0 else list(reversed(configs))):
            run_steps = steps if accumulate == 1 else max(10, steps // 2)
            times = fit(spec, template, pool, method, accumulate, run_steps, warmup, workdir, kwargs)
            row = rows[key]
            row["gpu"] += times["gpu"]
            row["host"] += times["host"]
            row["round_medians"].append(statistics.median(times["gpu"]))
            log(f"[gpu overhead] {spec.name} round {r + 1}/{rounds} {key}: {statistics.median(times['gpu']):.3f} ms")
    for row in rows.values():
        row["mean_ms"] = statistics.fmean(row["gpu"])  # with measure_every_n_steps, the median is a resting step
        row["median_ms"] = statistics.median(row.pop("gpu"))
        row["host_median_ms"] = statistics.median(row.pop("host"))
    for row in rows.values():
        base = rows.get(row["baseline"]) if row["baseline"] else None
        if base is not None:
            row["ratio"] = row["median_ms"] / base["median_ms"]
            row["mean_ratio"] = row["mean_ms"] / base["mean_ms"]
            row["round_ratios"] = [a / b for a, b in zip(row["round_medians"], base["round_medians"])]
    return list(rows.values())


def run(rounds: int, steps: int, warmup: int, keys: list[str] | None = None, save=None, log=print,
        models: list[str] | None = None) -> dict[str, Any]:
    """Every model's configurations (``keys``: only these; ``models``: only these model names), ``save(result so
    far)`` after each model."""
    specs = model_specs(quick=False) + [efficientnet_spec(), gpt_spec()]
    unknown = set(models or ()) - {spec.name for spec in specs}
    if unknown:  # before anything runs: a misspelt name would otherwise drop its model silently
        raise ValueError(f"models: no model named {sorted(unknown)}; the names are {[spec.name for spec in specs]}")
    _quiet()
    configs = [c for c in lightning_configs() if keys is None or c[0] in keys]
    out: dict[str, Any] = {**environment(), "settings": {"rounds": rounds, "steps": steps, "warmup": warmup},
                           "models": {}, "rows": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gns_gpu_overhead_") as workdir:
        for spec in (spec for spec in specs if models is None or spec.name in models):
            chosen = [c for c in configs if spec.name not in CONFIGS or c[0] in CONFIGS[spec.name]]
            spec_steps = max(15, steps // SLOW_MODELS.get(spec.name, 1))
            out["models"][spec.name] = spec.description
            out["rows"] += measure_model(spec, chosen, rounds, spec_steps, warmup, workdir, log)
            out["elapsed_s"] = time.perf_counter() - started
            if save is not None:
                save(out)
    return out


def render(run_: dict[str, Any], command: str) -> str:
    s = run_["settings"]
    lines = [f"- Command (on the GPU machine): `{command}`",
             f"- Device: {run_['device']}; {run_['software']}; date {run_['date']}; {run_['elapsed_s']:.0f} s",
             f"- {s['rounds']} interleaved rounds, {s['steps']} timed optimizer steps per run after {s['warmup']} "
             "warm-up (accumulate=4 runs: half as many; EfficientNet-B0: a third, GPT-2 small: a quarter), median "
             "step time on the GPU "
             "timeline (CUDA events at each optimizer step, no sync during the fit).",
             "- Models: " + "; ".join(f"{k}: {v}" for k, v in run_["models"].items()), "",
             "| model | configuration | step (GPU timeline) | host step | ratio vs baseline | per-round ratios "
             "| ratio of means |",
             "|---|---|---|---|---|---|---|"]
    for row in run_["rows"]:
        ratio = f"**{row['ratio']:.3f}×**" if "ratio" in row else "—"
        rounds = ", ".join(f"{r:.3f}" for r in row.get("round_ratios", []))
        means = f"{row['mean_ratio']:.3f}×" if "mean_ratio" in row else "—"  # absent in results saved before it
        lines.append(f"| {row['model']} | {row['label']} | {row['median_ms']:.3f} ms | {row['host_median_ms']:.3f} ms "
                     f"| {ratio} | {rounds} | {means} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--configs", nargs="+", help="only these configuration keys (e.g. base_acc1 per_example "
                        "base_acc4 micro_batch)")
    parser.add_argument("--models", nargs="+", help="only these models, by name (e.g. MLP CNN Transformer "
                        "EfficientNet-B0)")
    parser.add_argument("--json", type=Path, help="write the measurements here (after each model)")
    parser.add_argument("--from-json", type=Path, help="no measuring: render a saved --json file")
    parser.add_argument("--out", type=Path, help="write/replace this benchmark's section of this markdown file")
    args = parser.parse_args(argv)
    command = "python benchmarks/gpu_overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        result = json.loads(args.from_json.read_text())
    else:
        if not torch.cuda.is_available():
            parser.error("needs a CUDA GPU (use --from-json to render saved measurements)")
        save = (lambda partial: args.json.write_text(json.dumps({**partial, "command": command}, indent=1))) \
            if args.json else None
        result = {**run(args.rounds, args.steps, args.warmup, args.configs, save, models=args.models),
                  "command": command}
    section = render(result, result.get("command", "python benchmarks/gpu_overhead.py --json gpu_overhead.json"))
    publish_section(section, args.out, SECTION_HEADING)
    return 0


if __name__ == "__main__":
    sys.exit(main())
