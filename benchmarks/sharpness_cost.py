#!/usr/bin/env python
"""Cost of :class:`gns_callback.lightning.sharpness.SharpnessMonitor` per fit, and what its schedule finds.

    python benchmarks/sharpness_cost.py [--steps 1100] [--threads 1]

Digits (scikit-learn, 1797 real images), i.i.d. batches of 32 with replacement, SGD (momentum 0.9), Lightning
``Trainer.fit`` for ``--steps`` optimizer steps (logger, checkpointing, progress bar off), on two models: the
MLP 64-64-10 (tanh) of the LR-transfer benchmark, and a small CNN (two 3×3 convs with GroupNorm, 8 channels).
Each model is fitted twice from the same seed, with and without the monitor (default schedule: global steps
4, 8, ..., 1024), and the fits are checked to end with identical weights. Reported: wall time of each fit,
the time spent inside the monitor (``on_train_batch_start``, all measurements), its share of the fit, the
Hessian-vector products per measurement, and the values measured. A second pass ("every 4 steps") measures
λ_max of the current batch every 4 steps up to the last scheduled step, to compare the schedule's maximum with
the maximum along the run at that resolution.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import curvature  # noqa: E402
from gns_callback.lightning import sharpness as sharpness_module  # noqa: E402
from gns_callback.lightning.sharpness import DEFAULT_STEPS, SharpnessMonitor  # noqa: E402

warnings.filterwarnings("ignore")


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10),
    )


class Classifier(pl.LightningModule):
    def __init__(self, build, lr: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.lr = build(), lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Timed(pl.Callback):
    """Calls the monitor (the callback's one line) and adds up the time spent in it; with ``full_data``, also
    the full-data λ_max (converged power iteration, untimed) wherever the monitor measured."""

    def __init__(self, monitor: SharpnessMonitor, full_data=None) -> None:
        self.monitor, self.seconds, self.full_data, self.full = monitor, 0.0, full_data, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        before = len(self.monitor.measurements)
        start = time.perf_counter()
        self.monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self.seconds += time.perf_counter() - start
        if self.full_data is not None and len(self.monitor.measurements) > before:
            x, y = self.full_data
            self.full.append(curvature.sharpness(lambda: F.cross_entropy(pl_module.net(x), y),
                                                 list(pl_module.parameters()), max_iterations=200, rtol=1e-5))


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def fit(build, lr: float, steps: int, monitor=None, full_data=None):
    x, y = digits()
    sampler = RandomSampler(range(len(x)), replacement=True, num_samples=32 * steps,
                            generator=torch.Generator().manual_seed(1))
    module = Classifier(build, lr)
    timed = Timed(monitor, full_data) if monitor is not None else None
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[timed] if timed else [])
    start = time.perf_counter()
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=32, sampler=sampler))
    return module, time.perf_counter() - start, timed


def count_products() -> list[int]:
    """Patch the monitor's Lanczos so that each call records its number of Hessian-vector products."""
    counts: list[int] = []
    real = curvature.lanczos_top_eigenvalue

    def counted(matvec, start, **kwargs):
        n = [0]

        def product(v):
            n[0] += 1
            return matvec(v)

        value = real(product, start, **kwargs)
        counts.append(n[0])
        return value

    sharpness_module.lanczos_top_eigenvalue = counted
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"Hardware: {platform.machine()}, torch {torch.__version__}, {args.threads} thread(s); "
          f"{args.steps} steps of batch 32, SGD momentum 0.9")
    counts = count_products()
    print("| model | params | fit without (s) | fit with (s) | in the monitor (s) | in training steps | "
          "products per measurement | batch λ_max at 4, 8, ..., 1024 | largest | every-4-steps max (≤1024) | "
          "full-data λ_max at 4, ..., 1024 (max) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, build, lr in (("MLP 64-64-10", mlp, 0.3), ("CNN 2×conv8+GN", cnn, 0.1)):
        counts.clear()
        plain, t_plain, _ = fit(build, lr, args.steps)
        monitor = SharpnessMonitor()
        measured, t_with, timed = fit(build, lr, args.steps, monitor)
        t_monitor = timed.seconds
        counted = list(counts)
        _, _, full = fit(build, lr, args.steps, SharpnessMonitor(), digits())
        same = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), measured.state_dict().values()))
        products = f"{min(counted)}–{max(counted)} (mean {sum(counted) / len(counted):.1f})"
        dense = SharpnessMonitor(steps=range(4, DEFAULT_STEPS[-1] + 1, 4))
        fit(build, lr, min(args.steps, DEFAULT_STEPS[-1] + 1), dense)
        values = ", ".join(f"{v:.3g}" for _, v in monitor.measurements)
        params = sum(p.numel() for p in plain.parameters())
        step_seconds = (t_with - t_monitor) / args.steps
        print(f"| {name} | {params} | {t_plain:.1f} | {t_with:.1f} | {t_monitor:.2f} | "
              f"{t_monitor / step_seconds:.0f} | {products} | {values} | {monitor.largest:.3g} | {dense.largest:.3g} "
              f"(at step {max(dense.measurements, key=lambda m: m[1])[0]}) | "
              f"{', '.join(f'{v:.3g}' for v in full.full)} ({max(full.full):.3g}) |" + ("" if same else " WEIGHTS DIFFER"))


if __name__ == "__main__":
    main()
