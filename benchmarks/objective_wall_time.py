"""``objective="time"`` measured: is the batch it picks faster to a target loss than the knee's?

Two cases, on scikit-learn's digits (all 1797 examples, pixels/16), one torch thread, Lightning on the CPU:

(a) *throughput grows with the micro-batch*: a deep, narrow MLP (64 → 32 ×6 → 10, tanh), where the fixed cost of
    a step (kernel launches, optimizer, Lightning's loop) dominates the per-example compute. One measuring fit at
    the current batch (32, SGD lr 0.3) with ``GradientNoiseScaleCallback(probe=True, objective="time")`` gives the
    three plans. Then both the knee's plan (``"balanced"``) and the ``"time"`` plan — each with its own batch and
    the LR the recommendation gives it — are trained from the same initialisation until the full-data
    cross-entropy first reaches the target, 3 data-order seeds, interleaved (knee, time, knee, time, ...). The
    wall time runs from the first training batch to the step that reaches the target; the full-data loss
    evaluations (every few steps) are timed and subtracted.
(b) *flat throughput*: a wide MLP (64 → 1024 → 1024 → 10), compute-bound at every micro-batch the probe times.
    A short fit with the probe gives its measured step times; ``recommend(objective="time")`` on that probe for
    B_noise from 10 to 10⁵ must never accumulate on one device.

    python benchmarks/objective_wall_time.py [--out benchmarks/RESULTS.md]   # ~3-5 min on 2 shared CPU cores
    python benchmarks/objective_wall_time.py --quick                        # smoke run, < 1 min
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytorch_lightning as pl  # noqa: E402

from gns_callback import GradientNoiseScaleCallback  # noqa: E402
from gns_callback.recommendation import recommend  # noqa: E402

SECTION_HEADING = "## Objective `time` against the knee: wall time to the same loss (issue 13)"


@dataclass(frozen=True)
class Config:
    current_batch: int = 32
    lr: float = 0.3
    measure_epochs: int = 6
    target: float = 0.15
    seeds: int = 3
    max_steps: int = 6000
    eval_every: int = 5
    depth: int = 6
    width: int = 32
    wide: int = 1024
    flat_steps: int = 12
    memory: int = 64 * 2**20  # the probe's memory budget (CPU: accounting), so that it stops at a few thousand


QUICK = Config(measure_epochs=2, target=0.8, seeds=1, max_steps=600, flat_steps=4, wide=256)


def load_data() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def deep_narrow(cfg: Config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(64, cfg.width), nn.Tanh()]
    for _ in range(cfg.depth - 1):
        layers += [nn.Linear(cfg.width, cfg.width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(cfg.width, 10))


def wide(cfg: Config, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, cfg.wide), nn.Tanh(), nn.Linear(cfg.wide, cfg.wide), nn.Tanh(),
                         nn.Linear(cfg.wide, 10))


class Classifier(pl.LightningModule):
    def __init__(self, net: nn.Module, lr: float) -> None:
        super().__init__()
        self.net, self.lr = net, lr

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(x: torch.Tensor, y: torch.Tensor, batch: int, seed: int) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch, shuffle=True,
                                       drop_last=True, generator=generator)


def trainer(callbacks: list, **kw: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw)


class StopAtLoss(pl.Callback):
    """Full-data loss every ``every`` steps (timed apart); stops the fit when it first reaches ``target``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, target: float, every: int) -> None:
        self.x, self.y, self.target, self.every = x, y, target, every
        self.start = self.end = None
        self.eval_seconds, self.steps, self.reached = 0.0, 0, False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every:
            return
        t = time.perf_counter()
        with torch.no_grad():
            loss = F.cross_entropy(pl_module.net(self.x), self.y).item()
        self.eval_seconds += time.perf_counter() - t
        if loss <= self.target or not loss < 1e6:
            self.reached, self.steps, self.end = loss <= self.target, trainer.global_step, time.perf_counter()
            trainer.should_stop = True

    @property
    def wall(self) -> Optional[float]:
        return None if not self.reached else self.end - self.start - self.eval_seconds


def measure_plans(
    cfg: Config, x: torch.Tensor, y: torch.Tensor, net: nn.Module, **fit: Any
) -> GradientNoiseScaleCallback:
    """One fit at the current batch with the probe and ``objective="time"``: the callback holds the plans."""
    with tempfile.TemporaryDirectory() as tmp:
        cb = GradientNoiseScaleCallback(probe=True, objective="time", verbose=False, memory_budget_bytes=cfg.memory,
                                        report_path=os.path.join(tmp, "gns.json"))
        trainer([cb], **fit).fit(Classifier(net, cfg.lr), loader(x, y, cfg.current_batch, seed=100))
    return cb


def to_target(cfg: Config, x: torch.Tensor, y: torch.Tensor, batch: int, lr: float, seed: int) -> StopAtLoss:
    stop = StopAtLoss(x, y, cfg.target, cfg.eval_every)
    trainer([stop], max_steps=cfg.max_steps, max_epochs=-1).fit(Classifier(deep_narrow(cfg), lr),
                                                                 loader(x, y, batch, seed))
    return stop


def case_overhead(cfg: Config, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    cb = measure_plans(cfg, x, y, deep_narrow(cfg), max_epochs=cfg.measure_epochs)
    rec = cb.recommendation
    knee, fast = rec.plans["balanced"], rec.plans["time"]
    runs: dict[str, list[StopAtLoss]] = {"balanced": [], "time": []}
    for seed in range(cfg.seeds):
        for name, plan in (("balanced", knee), ("time", fast)):
            runs[name].append(to_target(cfg, x, y, plan.batch_size, plan.learning_rate, seed))
    return {"rec": rec, "probe": cb.probe, "runs": runs}


def case_flat(cfg: Config, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    cb = measure_plans(cfg, x, y, wide(cfg), max_steps=cfg.flat_steps)
    checks = []
    for b_noise in (10.0, 100.0, 1000.0, 1e4, 1e5):
        estimate = {"b_simple": b_noise, "ci_low": b_noise / 1.2, "ci_high": b_noise * 1.2, "steps": 1000}
        r = recommend(estimate, current_batch_size=cfg.current_batch, current_lr=cfg.lr, probe=cb.probe,
                      objective="time", optimizer="SGD")
        checks.append((b_noise, r.plans["time"]))
    return {"rec": cb.recommendation, "probe": cb.probe, "checks": checks}


# ------------------------------------------------------------------------------------------------ report
def _rates(probe: Any) -> str:
    rows = []
    for size, timing in sorted(probe.timings.items()):
        interval = timing.samples_per_s_interval(size)
        noise = f" ±{timing.rel_halfwidth:.0%}" if interval else ""
        rows.append(f"{size}: {timing.samples_per_s(size):,.0f}{noise}")
    return "; ".join(rows)


def _plan_row(name: str, plan: Any) -> str:
    t = plan.time
    interval = f"{t.value:.3g} [{t.low:.3g}–{t.high:.3g}]" if t is not None else "–"
    return (f"| {name} | {plan.batch_size} | {plan.micro_batch_size} × {plan.accumulate_grad_batches} × "
            f"{plan.num_devices} | {plan.learning_rate:.3g} | {plan.steps.value:.3g} | {plan.examples.value:.3g} | "
            f"{interval} |")


def _wall(runs: list[StopAtLoss]) -> str:
    walls = [r.wall for r in runs]
    shown = ", ".join("not reached" if w is None else f"{w:.2f}" for w in walls)
    steps = ", ".join(str(r.steps) if r.reached else "–" for r in runs)
    return shown, steps


def render(cfg: Config, a: dict[str, Any], b: dict[str, Any], command: str, elapsed: float) -> str:
    rec = a["rec"]
    lines = [
        f"Command: `{command}` ({time.strftime('%Y-%m-%d')}). Hardware: {os.cpu_count()} CPU cores, "
        f"{platform.processor() or platform.machine()}; torch {torch.__version__}, 1 torch thread; shared machine "
        f"(load average {os.getloadavg()[0]:.2f} at the end). Whole benchmark: {elapsed:.0f} s.",
        "",
        f"**(a) Throughput grows with the micro-batch** (MLP 64 → {cfg.width} ×{cfg.depth} → 10, SGD; measuring fit "
        f"at batch {cfg.current_batch}, lr {cfg.lr}, {cfg.measure_epochs} epochs, probe on). Probe samples/s per "
        f"micro-batch: {_rates(a['probe'])} (probe cost {a['probe'].wall_seconds:.2g} s). Target of the recommendation "
        f"(`{rec.estimate_averaging}`): B = {rec.b_noise:.3g} [{rec.ci_low:.3g}–{rec.ci_high:.3g}].",
        "",
        "| objective | batch | micro × accumulate × devices | LR | steps vs current | examples vs current | "
        "predicted time vs current [interval] |",
        "|---|---:|---|---:|---:|---:|---|",
    ]
    lines += [_plan_row(name, rec.plans[name]) for name in ("balanced", "time", "cost")]
    lines += ["", f"Wall time to full-data cross-entropy ≤ {cfg.target} (s, seconds of training without the loss "
                  f"evaluations; seeds interleaved):", "",
              "| plan | batch | LR | wall s per seed | median | steps per seed |", "|---|---:|---:|---|---:|---|"]
    medians = {}
    for name in ("balanced", "time"):
        plan, runs = rec.plans[name], a["runs"][name]
        shown, steps = _wall(runs)
        walls = [r.wall for r in runs if r.wall is not None]
        medians[name] = statistics.median(walls) if len(walls) == len(runs) else None
        med = f"{medians[name]:.2f}" if medians[name] is not None else "–"
        lines.append(f"| {name} | {plan.batch_size} | {plan.learning_rate:.3g} | {shown} | {med} | {steps} |")
    if medians["balanced"] and medians["time"]:
        lines += ["", f"Measured: time/knee = {medians['time'] / medians['balanced']:.2f} (median wall time); "
                      f"predicted {rec.plans['time'].time.value / rec.plans['balanced'].time.value:.2f}."]
    lines += ["", f"**(b) Flat throughput** (MLP 64 → {cfg.wide} → {cfg.wide} → 10, {cfg.flat_steps} steps at "
                  f"batch {cfg.current_batch} with the probe). Probe samples/s per micro-batch: {_rates(b['probe'])}.",
              "", "| B_noise | time plan: batch | micro × accumulate × devices |", "|---:|---:|---|"]
    for b_noise, plan in b["checks"]:
        lines.append(f"| {b_noise:g} | {plan.batch_size} | {plan.micro_batch_size} × {plan.accumulate_grad_batches}"
                     f" × {plan.num_devices} |")
    never = all(p.accumulate_grad_batches == 1 for _, p in b["checks"])
    lines += ["", f"Accumulation in the time plan for any B_noise: {'never' if never else '**yes**'}."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", help="RESULTS.md to update (its section is replaced)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else Config()
    start = time.perf_counter()
    x, y = load_data()
    a = case_overhead(cfg, x, y)
    b = case_flat(cfg, x, y)
    command = "python benchmarks/objective_wall_time.py" + (" --quick" if args.quick else "") + (
        f" --out {args.out}" if args.out else "")
    text = render(cfg, a, b, command, time.perf_counter() - start)
    print(text)
    if args.out:
        from benchmarks.results import replace_section

        replace_section(args.out, SECTION_HEADING, text)
    return text


if __name__ == "__main__":
    import logging

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    main()
