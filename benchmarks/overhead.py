#!/usr/bin/env python
"""Step-time overhead of ``GradientNoiseScaleCallback``, and of public per-example-norm peers.

    python benchmarks/overhead.py [--quick] [--out benchmarks/RESULTS.md] [--threads 1]
    python benchmarks/overhead.py --profile [--models CNN]    # where the per-example time goes

What is measured (one process, same models, same synthetic data, CPU):

* Lightning ``Trainer.fit`` (logger, checkpointing, progress bar and model summary off), a fixed number
  of optimizer steps. A timing callback stamps ``time.perf_counter()`` (wall) and the thread's CPU time
  each time ``trainer.global_step`` advances (in ``on_train_batch_end``); the first ``--warmup`` steps are
  dropped and the median step time is kept.

  - ``baseline`` (no callback) at ``accumulate_grad_batches=1`` and ``=4``;
  - ``micro_batch`` (callback, ``accumulate_grad_batches=4``) / baseline at 4 — target <= 1.05x;
  - ``per_example`` (callback defaults, ``accumulate_grad_batches=1``) / baseline at 1 — target <= 1.25x;
    where the callback subsamples examples by default (``per_example_max_examples``), also all examples.

* Plain-PyTorch loop (``zero_grad``, forward, backward, per-example norms, ``SGD.step``) for the peers,
  each run step-by-step alternating with the same plain loop without per-example norms (paired baseline):

  - ``gns_callback`` ``PerExampleNormTracker`` (the hooks the callback uses, without Lightning; all examples);
  - ``torch.func``: ``vmap(grad(functional_call))`` per-example gradients, their norms, and their mean
    as the step's gradient (one vectorised backward replaces the ordinary one);
  - BackPACK ``BatchL2Grad`` (``extend`` + ``with backpack(...)``);
  - Opacus ``GradSampleModule`` (materialised ``grad_sample``, then norms);
  - Opacus ``GradSampleModuleFastGradientClipping`` with ghost clipping (norms without materialising,
    where Opacus has a norm sampler: Linear, Embedding; the rest materialised).

  Peers are optional: a peer that is not installed is skipped (and said so); a peer that cannot handle a
  model is recorded as unsupported with the reason.

Rounds are interleaved (every configuration once per round, the order reversed on odd rounds) to spread
drift on a shared machine over all configurations. Ratios are ratios of the medians pooled over rounds,
for wall time and for CPU time (robust to other processes on the cores); the per-round ratios show the
noise. Per-example norms of one probe batch are cross-checked against ``torch.func`` (max relative
difference) so that every peer is known to compute the same quantity.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime
import importlib
import inspect
import logging
import os
import platform
import re
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytorch_lightning as pl  # noqa: E402

from gns_callback import GradientNoiseScaleCallback  # noqa: E402
from gns_callback.per_example import PerExampleNormTracker  # noqa: E402

from benchmarks.results import replace_section  # noqa: E402  (shared by the benchmarks writing RESULTS.md)

SECTION_HEADING = "## Overhead (issue: step-time ratio with callback / without)"
TARGETS = {"micro_batch": 1.05, "per_example": 1.25}
LR = 1e-3


# ---------------------------------------------------------------------------------------------- models


def make_mlp(in_dim: int, hidden: int, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes)
    )


def make_cnn(channels: tuple[int, int, int], groups: int, classes: int) -> nn.Module:
    c1, c2, c3 = channels
    return nn.Sequential(
        nn.Conv2d(3, c1, 3, padding=1), nn.GroupNorm(groups, c1), nn.ReLU(),
        nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.GroupNorm(groups, c2), nn.ReLU(),
        nn.Conv2d(c2, c3, 3, stride=2, padding=1), nn.GroupNorm(groups, c3), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c3, classes),
    )  # fmt: skip


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention from four ``nn.Linear`` (``nn.MultiheadAttention`` has bare Parameters)."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class TinyTransformer(nn.Module):
    """Token + position embeddings, one pre-LN block (attention + GELU MLP), final LayerNorm, LM head."""

    def __init__(self, vocab: int, seq_len: int, d_model: int, heads: int, d_mlp: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_mlp)
        self.fc2 = nn.Linear(d_mlp, d_model)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        # (B, T), batch dim 0 for per-example hooks; contiguous because Opacus' embedding norm sampler .view()s it
        positions = torch.arange(t, device=tokens.device).expand(b, t).contiguous()
        h = self.tok(tokens) + self.pos(positions)
        h = h + self.attn(self.ln1(h))
        h = h + self.fc2(F.gelu(self.fc1(self.ln2(h))))
        return self.head(self.ln_f(h))


def classification_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@dataclass
class ModelSpec:
    name: str
    description: str
    batch: int
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step_factor: int = 1  # cheap models get more timed plain-loop steps ...
    lightning_repeats: int = 1  # ... and their Lightning runs repeated within each round (finer interleaving)


def model_specs(quick: bool) -> list[ModelSpec]:
    if quick:
        mlp = dict(in_dim=32, hidden=16, classes=4, batch=8)
        cnn = dict(channels=(4, 8, 8), groups=2, image=8, classes=4, batch=4)
        tfm = dict(vocab=32, seq_len=8, d_model=16, heads=2, d_mlp=32, batch=4)
    else:
        mlp = dict(in_dim=784, hidden=512, classes=10, batch=128)
        cnn = dict(channels=(32, 64, 64), groups=8, image=32, classes=10, batch=64)
        tfm = dict(vocab=512, seq_len=64, d_model=128, heads=4, d_mlp=512, batch=32)

    def mlp_batch(g: torch.Generator):
        return torch.randn(mlp["batch"], mlp["in_dim"], generator=g), torch.randint(mlp["classes"], (mlp["batch"],), generator=g)

    def cnn_batch(g: torch.Generator):
        x = torch.randn(cnn["batch"], 3, cnn["image"], cnn["image"], generator=g)
        return x, torch.randint(cnn["classes"], (cnn["batch"],), generator=g)

    def tfm_batch(g: torch.Generator):
        tokens = torch.randint(tfm["vocab"], (tfm["batch"], tfm["seq_len"] + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    c1, c2, c3 = cnn["channels"]
    return [
        ModelSpec(
            "MLP",
            f"{mlp['in_dim']}→{mlp['hidden']}→{mlp['hidden']}→{mlp['classes']}, ReLU",
            mlp["batch"],
            lambda: make_mlp(mlp["in_dim"], mlp["hidden"], mlp["classes"]),
            mlp_batch,
            classification_loss,
            step_factor=1 if quick else 3,
            lightning_repeats=1 if quick else 3,
        ),
        ModelSpec(
            "CNN",
            f"3×{cnn['image']}×{cnn['image']}, Conv3×3 {c1}/{c2}(s2)/{c3}(s2) + GroupNorm({cnn['groups']}) + ReLU, "
            f"avg-pool, Linear",
            cnn["batch"],
            lambda: make_cnn(cnn["channels"], cnn["groups"], cnn["classes"]),
            cnn_batch,
            classification_loss,
        ),
        ModelSpec(
            "Transformer",
            f"vocab {tfm['vocab']}, seq {tfm['seq_len']}, d_model {tfm['d_model']}, {tfm['heads']} heads, "
            f"MLP {tfm['d_mlp']}, 1 pre-LN block (attention from Linear q/k/v/out), LM head",
            tfm["batch"],
            lambda: TinyTransformer(tfm["vocab"], tfm["seq_len"], tfm["d_model"], tfm["heads"], tfm["d_mlp"]),
            tfm_batch,
            lm_loss,
        ),
    ]


# ---------------------------------------------------------------------------------------------- data


class CycledBatches(torch.utils.data.Dataset):
    """``length`` ready-made batches cycling over a small pool (``DataLoader(batch_size=None)``)."""

    def __init__(self, pool: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        self.pool, self.length = pool, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.pool[index % len(self.pool)]


def batch_pool(spec: ModelSpec, size: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [spec.make_batch(generator) for _ in range(size)]


# ---------------------------------------------------------------------------------------------- Lightning


class BenchModule(pl.LightningModule):
    def __init__(self, net: nn.Module, loss: Callable, pool: list, batches: int) -> None:
        super().__init__()
        self.net, self.loss_fn, self.pool, self.batches = net, loss, pool, batches

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(CycledBatches(self.pool, self.batches), batch_size=None, shuffle=False)


class StepTimer(pl.Callback):
    """Stamps ``perf_counter`` and :data:`cpu_clock` at fit start and each time an optimizer step has completed."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []  # (wall, CPU)
        self._last_step = -1

    def on_train_start(self, trainer, pl_module) -> None:
        self.stamps = [(time.perf_counter(), cpu_clock())]
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step != self._last_step:
            self._last_step = trainer.global_step
            self.stamps.append((time.perf_counter(), cpu_clock()))

    def step_times(self) -> tuple[list[float], list[float]]:
        """(wall, CPU) seconds of each optimizer step."""
        pairs = list(zip(self.stamps, self.stamps[1:]))
        return [b[0] - a[0] for a, b in pairs], [b[1] - a[1] for a, b in pairs]


def lightning_run(spec: ModelSpec, template: nn.Module, pool: list, method: str | None, accumulate: int,
                  steps: int, warmup: int, workdir: str,
                  callback_kwargs: dict[str, Any] | None = None) -> tuple[list[float], list[float], dict[str, Any]]:
    """Wall and CPU step times (s) after warm-up of one ``Trainer.fit``, and info; ``method=None`` is the
    no-callback baseline."""
    total_steps = warmup + steps
    module = BenchModule(copy.deepcopy(template), spec.loss, pool, total_steps * accumulate)
    timer = StepTimer()
    callbacks: list[pl.Callback] = [timer]
    gns = None
    if method is not None:
        gns = GradientNoiseScaleCallback(
            method=method, verbose=False, report_path=os.path.join(workdir, f"gns_{spec.name}_{method}.json"),
            **(callback_kwargs or {}),
        )
        callbacks.append(gns)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, max_steps=total_steps, accumulate_grad_batches=accumulate,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, default_root_dir=workdir,
    )  # fmt: skip
    trainer.fit(module)
    times, cpu_times = timer.step_times()
    if len(times) != total_steps:
        raise RuntimeError(f"expected {total_steps} optimizer steps, timed {len(times)}")
    info: dict[str, Any] = {}
    if gns is not None:
        info = {"measured_steps": gns.estimate.steps, "coverage": gns.coverage.get("fraction")}
    return times[warmup:], cpu_times[warmup:], info


# ---------------------------------------------------------------------------------------------- plain loop


def per_example_loss_fn(spec: ModelSpec, net: nn.Module):
    """``loss(params, buffers, x_i, y_i)`` of one example, for ``torch.func``."""
    from torch.func import functional_call

    def loss_one(params, buffers, x, y):
        out = functional_call(net, (params, buffers), (x.unsqueeze(0),))
        return spec.loss(out, y.unsqueeze(0))

    return loss_one


class PlainStep:
    """One optimizer step of a plain-PyTorch loop; ``__call__`` returns the (B,) per-example squared norms
    (for the probe) or None for the baseline. ``scale`` turns them into norms of per-example-loss gradients."""

    scale_by_batch_squared = False

    def __init__(self, spec: ModelSpec, net: nn.Module) -> None:
        self.spec, self.net = spec, net
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.optimizer = torch.optim.SGD(self.params, lr=LR)
        self.total = torch.zeros(())  # per-example norms are consumed (summed) every step, as a user would

    def forward_backward(self, x, y):
        loss = self.spec.loss(self.net(x), y)
        loss.backward()

    def norms(self, batch_size: int) -> torch.Tensor | None:
        return None

    def __call__(self, x, y) -> torch.Tensor | None:
        self.optimizer.zero_grad(set_to_none=True)
        self.forward_backward(x, y)
        sq = self.norms(x.shape[0])
        if sq is not None:
            self.total += sq.sum()
        self.optimizer.step()
        return sq

    def close(self) -> None:
        pass


class GnsTrackerStep(PlainStep):
    scale_by_batch_squared = True

    def __init__(self, spec, net):
        super().__init__(spec, net)
        self.tracker = PerExampleNormTracker(net).attach()

    def norms(self, batch_size):
        return self.tracker.pop()

    def close(self):
        self.tracker.detach()


class TorchFuncStep(PlainStep):
    def __init__(self, spec, net):
        super().__init__(spec, net)
        from torch.func import grad, vmap

        self.names = [n for n, p in net.named_parameters() if p.requires_grad]
        self.per_example_grads = vmap(grad(per_example_loss_fn(spec, net)), in_dims=(None, None, 0, 0))
        self._grads: dict[str, torch.Tensor] = {}

    def forward_backward(self, x, y):
        params = {n: p.detach() for n, p in self.net.named_parameters() if p.requires_grad}
        buffers = {n: b.detach() for n, b in self.net.named_buffers()}
        self._grads = self.per_example_grads(params, buffers, x, y)
        for name, p in zip(self.names, self.params):  # the batch gradient of the mean loss
            p.grad = self._grads[name].mean(dim=0)

    def norms(self, batch_size):
        return torch.stack([g.reshape(batch_size, -1).square().sum(dim=1) for g in self._grads.values()]).sum(dim=0)


class BackpackStep(PlainStep):
    scale_by_batch_squared = True

    def __init__(self, spec, net):
        from backpack import extend

        super().__init__(spec, extend(net))

    def forward_backward(self, x, y):
        from backpack import backpack
        from backpack.extensions import BatchL2Grad

        with backpack(BatchL2Grad()):
            super().forward_backward(x, y)

    def norms(self, batch_size):
        missing = [type(m).__name__ for m in self.net.modules()
                   for p in m.parameters(recurse=False) if p.requires_grad and not hasattr(p, "batch_l2")]  # fmt: skip
        if missing:
            raise NotImplementedError(f"BatchL2Grad left no batch_l2 on {', '.join(sorted(set(missing)))} parameters")
        return torch.stack([p.batch_l2 for p in self.params]).sum(dim=0)


class OpacusStep(PlainStep):
    def __init__(self, spec, net):
        from opacus import GradSampleModule

        super().__init__(spec, net)
        self.net = GradSampleModule(net, batch_first=True, loss_reduction="mean")

    def norms(self, batch_size):
        sq = torch.stack([p.grad_sample.reshape(batch_size, -1).square().sum(dim=1) for p in self.params]).sum(dim=0)
        for p in self.params:
            p.grad_sample = None
        return sq

    def close(self):
        self.net._close()


class OpacusGhostStep(PlainStep):
    def __init__(self, spec, net):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping

        super().__init__(spec, net)
        self.net = GradSampleModuleFastGradientClipping(
            net, batch_first=True, loss_reduction="mean", max_grad_norm=1.0, use_ghost_clipping=True
        )

    def norms(self, batch_size):
        return self.net.get_norm_sample().square()

    def close(self):
        self.net._close()


@dataclass
class PlainConfig:
    key: str
    label: str
    step: type[PlainStep]
    package: str | None = None  # import name of the optional peer


PLAIN_CONFIGS = [
    PlainConfig("plain", "baseline (plain loop)", PlainStep),
    PlainConfig("gns_tracker", "gns_callback PerExampleNormTracker", GnsTrackerStep),
    PlainConfig("torch_func", "torch.func vmap(grad) + norms", TorchFuncStep),
    PlainConfig("backpack", "BackPACK BatchL2Grad", BackpackStep, "backpack"),
    PlainConfig("opacus", "Opacus GradSampleModule + norms", OpacusStep, "opacus"),
    PlainConfig("opacus_ghost", "Opacus ghost-clipping norms", OpacusGhostStep, "opacus"),
]


def paired_plain_run(base: PlainStep, step: PlainStep, pool: list, steps: int, warmup: int,
                     budget_s: float) -> tuple[list[float], list[float], list[float], list[float]]:
    """Step times (s) after warm-up of the baseline loop and of a peer's loop, alternating step by step (which
    one goes first alternates too), so that both see the same load on a shared machine. A pair whose first
    iteration shows that ``warmup + steps`` would take longer than ``budget_s`` is cut to 2 warm-up + as many
    timed steps as fit (at least 5). Returns wall times (baseline, peer) and CPU times (baseline, peer)."""
    base_times: list[float] = []
    times: list[float] = []
    base_cpu: list[float] = []
    cpu: list[float] = []
    total, i = warmup + steps, 0
    while i < total:
        x, y = pool[i % len(pool)]
        for which in ((base, step) if i % 2 == 0 else (step, base)):
            start, start_cpu = time.perf_counter(), cpu_clock()
            which(x, y)
            (base_times if which is base else times).append(time.perf_counter() - start)
            (base_cpu if which is base else cpu).append(cpu_clock() - start_cpu)
        i += 1
        if i == 1 and (base_times[0] + times[0]) * total > budget_s:
            warmup = min(warmup, 2)
            total = warmup + max(5, min(steps, int(budget_s / (base_times[0] + times[0])) - warmup))
    return base_times[warmup:], times[warmup:], base_cpu[warmup:], cpu[warmup:]


def probe_norms(config: PlainConfig, spec: ModelSpec, template: nn.Module, batch) -> torch.Tensor:
    """Per-example squared norms of per-example-loss gradients for one batch (parameters not updated)."""
    net = copy.deepcopy(template)
    step = config.step(spec, net)
    try:
        step.optimizer = torch.optim.SGD(step.params, lr=0.0)
        x, y = batch
        sq = step(x, y)
        if sq is None:
            raise RuntimeError("no per-example norms returned")
        sq = sq.detach().double()
        return sq * x.shape[0] ** 2 if config.step.scale_by_batch_squared else sq
    finally:
        step.close()


# ---------------------------------------------------------------------------------------------- driver


@dataclass
class Result:
    model: str
    batch: int
    loop: str  # "Lightning" or "plain"
    key: str
    label: str
    baseline_key: str | None
    times: list[float] = field(default_factory=list)  # pooled over rounds, seconds
    round_medians: list[float] = field(default_factory=list)
    base_times: list[float] = field(default_factory=list)  # plain loop: the baseline steps paired with these
    base_round_medians: list[float] = field(default_factory=list)
    cpu_times: list[float] = field(default_factory=list)
    base_cpu_times: list[float] = field(default_factory=list)
    cpu_ratio: float | None = None
    status: str = "ok"  # "ok", "unsupported: ...", "not installed"
    info: dict[str, Any] = field(default_factory=dict)
    ratio: float | None = None
    ratio_of_means: float | None = None
    round_ratios: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float | None:
        return 1000 * statistics.median(self.times) if self.times else None

    @property
    def cpu_median_ms(self) -> float | None:
        return 1000 * statistics.median(self.cpu_times) if self.cpu_times else None


#: Subsampling option of ``per_example`` (if this version of the callback has it).
MAX_EXAMPLES_ARG = "per_example_max_examples"
#: Duty-cycle option (if this version of the callback has it). With it, most steps are not measured, so the
#: median step hides the measured ones: read its rows' *ratio of means*.
EVERY_ARG = "measure_every_n_steps"


def lightning_configs() -> list[tuple[str, str, str | None, int, str | None, dict[str, Any]]]:
    """(key, label, method, accumulate, baseline key, callback kwargs). ``per_example`` runs with the
    callback's defaults; where it subsamples examples by default, an all-examples row is added."""
    parameter = inspect.signature(GradientNoiseScaleCallback).parameters.get(MAX_EXAMPLES_ARG)
    default = parameter.default if parameter is not None else None
    per_example_label = "per_example, accumulate=1"
    if default is not None:
        per_example_label = f"per_example (default {MAX_EXAMPLES_ARG}={default}), accumulate=1"
    configs = [
        ("base_acc1", "baseline, accumulate=1", None, 1, None, {}),
        ("per_example", per_example_label, "per_example", 1, "base_acc1", {}),
    ]
    if default is not None:
        configs.append(("per_example_all", f"per_example ({MAX_EXAMPLES_ARG}=None: all examples), accumulate=1",
                        "per_example", 1, "base_acc1", {MAX_EXAMPLES_ARG: None}))  # fmt: skip
    configs.append(("per_example_nosharp", f"{per_example_label.split(',')[0]}, sharpness=False, accumulate=1",
                    "per_example", 1, "base_acc1", {"sharpness": False}))  # the sharpness monitor's share (SGD)
    configs += [
        ("base_acc4", "baseline, accumulate=4", None, 4, None, {}),
        ("micro_batch", "micro_batch, accumulate=4", "micro_batch", 4, "base_acc4", {}),
        ("micro_batch_nosharp", "micro_batch, sharpness=False, accumulate=4", "micro_batch", 4, "base_acc4",
         {"sharpness": False}),
    ]
    if EVERY_ARG in inspect.signature(GradientNoiseScaleCallback).parameters:  # one step in 4: read the ratio of means
        quarter = {"sharpness": False, EVERY_ARG: 4}
        configs.insert(4, ("per_example_every4", f"{per_example_label.split(',')[0]}, sharpness=False, {EVERY_ARG}=4, "
                           "accumulate=1", "per_example", 1, "base_acc1", quarter))
        configs.append(("micro_batch_every4", f"micro_batch, sharpness=False, {EVERY_ARG}=4, accumulate=4",
                        "micro_batch", 4, "base_acc4", quarter))
    return configs


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _quiet():
    """Silence Lightning's info lines and known harmless warnings."""
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric", "opacus"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    warnings.filterwarnings("ignore", ".*You called `self.log`.*")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(pytorch_lightning|lightning_fabric|opacus|backpack).*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", ".*Full backward hook is firing.*")  # Opacus' hooks on the first layer
    warnings.filterwarnings("ignore", ".*There is a performance drop.*")  # recorded by the probe instead


#: CPU-time clock of the timed work: the calling thread's CPU time with one torch thread (forward, backward
#: and the hooks all run on it on CPU), the process's with more. Unlike wall time, it barely moves when other
#: processes compete for the cores, so its ratios are the robust ones on a shared machine.
cpu_clock: Callable[[], float] = time.thread_time


def set_threads(threads: int) -> None:
    global cpu_clock
    cpu_clock = time.thread_time if threads == 1 else time.process_time
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before inter-op parallel work started
        torch.set_num_interop_threads(1)


def run_benchmark(quick: bool = False, steps: int | None = None, warmup: int | None = None,
                  rounds: int | None = None, threads: int = 1, peers: bool = True, budget_s: float | None = None,
                  models: list[str] | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every configuration; returns ``{"results": [Result], "settings": {...}, "peers": {...}}``."""
    _quiet()
    set_threads(threads)
    steps = steps if steps is not None else (6 if quick else 20)
    warmup = warmup if warmup is not None else (2 if quick else 4)
    rounds = rounds if rounds is not None else (1 if quick else 4)
    budget_s = budget_s if budget_s is not None else (2.0 if quick else 12.0)
    specs = [s for s in model_specs(quick) if models is None or s.name.lower() in {m.lower() for m in models}]

    peer_versions: dict[str, str] = {}
    plain_configs = []
    for config in PLAIN_CONFIGS:
        if config.package is None:
            plain_configs.append(config)
            continue
        if not peers:
            peer_versions[config.package] = "skipped (--no-peers)"
            continue
        try:
            module = importlib.import_module(config.package)
            dist = {"backpack": "backpack-for-pytorch"}.get(config.package, config.package)
            peer_versions[config.package] = _dist_version(dist) or getattr(module, "__version__", "?")
            plain_configs.append(config)
        except Exception as exc:  # noqa: BLE001 - ImportError, or a peer broken by this torch version
            peer_versions[config.package] = f"not installed, skipped ({_first_line(exc)})"
            log(f"[overhead] {config.package} not installed: skipping {config.label}")

    results: list[Result] = []
    configs = lightning_configs()
    revision = package_revision()  # now: the code imported is the code at start
    load_start = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gns_overhead_") as workdir:
        for spec in specs:
            torch.manual_seed(0)
            template = spec.build()
            pool = batch_pool(spec)
            light = {key: Result(spec.name, spec.batch, "Lightning", key, label, base)
                     for key, label, _, _, base, _ in configs}  # fmt: skip
            plain = {c.key: Result(spec.name, spec.batch, "plain", c.key, c.label, None if c.key == "plain" else "plain")
                     for c in plain_configs}  # fmt: skip

            # Probe: can each peer run this model, and do all compute the same per-example norms?
            reference = None
            for config in plain_configs:
                if config.key == "plain":
                    continue
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        sq = probe_norms(config, spec, template, pool[0])
                    slow = sorted({op for w in caught if "batching rule" in str(w.message)
                                   for op in re.findall(r"aten::\w+", str(w.message))})  # fmt: skip
                    if slow:
                        plain[config.key].info["warning"] = f"no vmap batching rule for {', '.join(slow)} (slow fallback)"
                except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, not a crash
                    plain[config.key].status = f"unsupported: {_first_line(exc)}"
                    log(f"[overhead] {spec.name}: {config.label} unsupported ({_first_line(exc)})")
                    continue
                if config.key == "torch_func":
                    reference = sq
                plain[config.key].info["probe"] = sq
            for config in plain_configs:
                probe = plain[config.key].info.pop("probe", None)
                if probe is not None and reference is not None:
                    rel = ((probe - reference).abs() / reference.abs().clamp_min(1e-30)).max().item()
                    plain[config.key].info["max_rel_diff_vs_torch_func"] = rel

            jobs: list[tuple[str, Callable[[], None]]] = []
            model_steps = steps * spec.step_factor
            lightning_jobs: list[tuple[str, Callable[[], None]]] = []
            for key, _, method, accumulate, _, kwargs in configs:
                # accumulate=4 steps cost 4 micro-batches: half the optimizer steps, twice the micro-batches
                run_steps = steps if accumulate == 1 else max(5, steps // 2)

                def job(key=key, method=method, accumulate=accumulate, run_steps=run_steps, kwargs=kwargs):
                    times, cpu_times, info = lightning_run(spec, template, pool, method, accumulate, run_steps,
                                                           warmup, workdir, kwargs)  # fmt: skip
                    light[key].times += times
                    light[key].cpu_times += cpu_times
                    light[key].round_medians.append(statistics.median(times))
                    light[key].info.update(info)
                lightning_jobs.append((f"Lightning {key}", job))
            for repeat in range(spec.lightning_repeats):
                jobs += lightning_jobs if repeat % 2 == 0 else list(reversed(lightning_jobs))
            plain_steps = max(5, model_steps // 2)  # paired with baseline steps: twice the work per step
            for config in plain_configs:
                if config.key == "plain":
                    continue

                def job(config=config):
                    result = plain[config.key]
                    if result.status != "ok":
                        return
                    base, step = PlainStep(spec, copy.deepcopy(template)), config.step(spec, copy.deepcopy(template))
                    try:
                        base_times, times, base_cpu, cpu = paired_plain_run(base, step, pool, plain_steps, warmup,
                                                                             budget_s)  # fmt: skip
                    finally:
                        step.close()
                    result.times += times
                    result.round_medians.append(statistics.median(times))
                    result.base_times += base_times
                    result.base_round_medians.append(statistics.median(base_times))
                    plain["plain"].times += base_times
                    result.cpu_times += cpu
                    result.base_cpu_times += base_cpu
                    plain["plain"].cpu_times += base_cpu
                jobs.append((f"plain {config.key} (paired with baseline)", job))

            for r in range(rounds):
                order = jobs if r % 2 == 0 else list(reversed(jobs))
                for name, job in order:
                    t0 = time.perf_counter()
                    job()
                    log(f"[overhead] {spec.name} round {r + 1}/{rounds} {name}: {time.perf_counter() - t0:.1f}s")

            for result in list(light.values()) + list(plain.values()):
                if result.baseline_key is None or result.status != "ok" or not result.times:
                    continue
                if result.loop == "Lightning":
                    base_result = light[result.baseline_key]
                    base_times, base_round_medians = base_result.times, base_result.round_medians
                    base_cpu = base_result.cpu_times
                else:
                    base_times, base_round_medians = result.base_times, result.base_round_medians
                    base_cpu = result.base_cpu_times
                result.cpu_ratio = statistics.median(result.cpu_times) / statistics.median(base_cpu)
                result.ratio = statistics.median(result.times) / statistics.median(base_times)
                result.ratio_of_means = statistics.fmean(result.times) / statistics.fmean(base_times)
                result.round_ratios = [a / b for a, b in zip(result.round_medians, base_round_medians)]
                if result.loop == "plain":
                    result.info["paired_baseline_ms"] = 1000 * statistics.median(base_times)
            results += list(light.values()) + list(plain.values())

    settings = {
        "quick": quick, "steps": steps, "warmup": warmup, "rounds": rounds, "threads": threads, "budget_s": budget_s,
        "cpu_clock": cpu_clock.__name__, "elapsed_s": time.perf_counter() - started, "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
        "models": {s.name: s.description for s in specs}, "revision": revision,
    }  # fmt: skip
    return {"results": results, "settings": settings, "peers": peer_versions}


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------- report


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def package_revision() -> str:
    """``gns_callback`` at commit X (read-only git calls; '+ uncommitted changes' if the package is dirty)."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "gns_callback")
    except (OSError, subprocess.SubprocessError):
        return "unknown revision"
    if not commit:
        return "unknown revision"
    return f"commit {commit}" + (" + uncommitted changes to gns_callback/" if dirty else "")


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def render(run: dict[str, Any], command: str) -> str:
    s = run["settings"]
    lines = [
        SECTION_HEADING,
        "",
        f"- Command: `{command}`",
        f"- Date: {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"- Hardware: `nproc` = {os.cpu_count()}, CPU: {cpu_model()}; no GPU. torch {torch.__version__}, "
        f"pytorch-lightning {pl.__version__}, Python {platform.python_version()}. "
        f"gns_callback: {run['settings'].get('revision', 'unknown revision')}.",
        f"- `torch.set_num_threads({s['threads']})` (inter-op threads 1) for every configuration.",
        f"- Two clocks: wall (`time.perf_counter`) and CPU time (`time.{s['cpu_clock']}`: "
        + ("with one torch thread, forward, backward and the hooks all run on the calling thread" if s["threads"] == 1
           else "all threads of the process") + "). "
        "On this shared machine other processes take turns on the cores, which inflates wall times by different "
        "amounts in different runs; CPU time does not count those turns, so the CPU-time ratio is the more "
        "reliable one here, while wall time is what a user sees on an idle machine.",
        "- Peers (benchmark-only, not package dependencies): "
        + (", ".join(f"{k} {v}" for k, v in run["peers"].items()) or "none")
        + "; torch.func from torch.",
        f"- Steps: {s['warmup']} warm-up + {s['steps']} timed optimizer steps per Lightning run (half as many, min "
        f"5, at accumulate=4, i.e. twice the micro-batches), {s['rounds']} interleaved round(s) (every "
        f"configuration once per round — the cheap MLP's Lightning runs 3 times — order reversed on odd rounds "
        f"and repeats). `timed steps` = pooled "
        f"over rounds; ms/step = median over all timed steps; ratio = that median / its baseline's; per-round = "
        f"the same ratio within each round; ratio of means includes the periodic work (e.g. logging every 50 "
        f"steps) that medians hide. Load average (1/5/15 min) at start {_fmt_load(s['loadavg_start'])}, at end "
        f"{_fmt_load(s['loadavg_end'])} (other work shares the 2 cores); total {s['elapsed_s']:.0f} s.",
        "- Lightning rows: `Trainer.fit` on CPU (logger/checkpointing/progress bar/model summary off), SGD, "
        "synthetic data from ready-made batches (`DataLoader(batch_size=None)`), step time between consecutive "
        "optimizer steps (includes Lightning's own per-step work). The callback runs with its defaults "
        "(`log_every_n_steps` = the Trainer's 50). Baseline for `per_example` is accumulate=1, for "
        "`micro_batch` accumulate=4 (ms/step there covers 4 micro-batches).",
        "- Plain rows: a plain-PyTorch loop (`zero_grad`, forward, backward, per-example squared norms summed "
        "into a running total, `SGD.step`). Each peer runs *paired* with the same loop without per-example "
        "norms on its own copy of the model: steps alternate baseline/peer (which goes first alternates too), so "
        "both see the same load; ratio = peer median / paired-baseline median (`baseline (plain loop)` pools "
        f"all paired baseline steps). Half as many timed steps per round as Lightning runs (×3 for the MLP); a pair whose first "
        f"step shows it would exceed {s['budget_s']:.0f} s is cut to 2 warm-up + as many timed steps as fit "
        "(min 5). `torch.func` replaces the ordinary backward by `vmap(grad)` and uses the mean per-example "
        "gradient as `.grad`. `max rel. diff` = largest relative difference of the per-example squared norms of "
        "one probe batch from `torch.func`'s.",
        "",
        "Models: " + "; ".join(f"**{k}**: {v}" for k, v in s["models"].items()) + ".",
        "",
        "| model | batch | loop | config | timed steps | ms/step | ratio | per-round ratios | ratio of means "
        "| CPU ms/step | CPU-time ratio | target | notes |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in run["results"]:
        target = TARGETS.get(r.key) if r.loop == "Lightning" else None
        target_text = ""
        if target is not None and r.ratio is not None:
            verdict = [("met" if value <= target else "**missed**") + f" ({clock})"
                       for value, clock in ((r.ratio, "wall"), (r.cpu_ratio, "CPU")) if value is not None]  # fmt: skip
            target_text = f"≤ {target:.2f}×: " + ", ".join(verdict)
        notes = []
        if r.status != "ok":
            notes.append(r.status.replace("|", "\\|"))
        if "max_rel_diff_vs_torch_func" in r.info and r.key != "torch_func":
            notes.append(f"max rel. diff {r.info['max_rel_diff_vs_torch_func']:.1e}")
        if r.info.get("paired_baseline_ms") is not None:
            notes.append(f"paired baseline {r.info['paired_baseline_ms']:.2f} ms")
        if r.info.get("warning"):
            notes.append(r.info["warning"].replace("|", "\\|"))
        if r.info.get("coverage") is not None:
            notes.append(f"coverage {r.info['coverage']:.0%}")
        if r.info.get("measured_steps") is not None:
            notes.append(f"callback measured {r.info['measured_steps']} steps per run")
        ms = "—" if r.median_ms is None else f"{r.median_ms:.2f}"
        ratio = _fmt_ratio(r.ratio) if r.baseline_key else "1.00× (baseline)"
        if r.status != "ok":
            ratio = "unsupported" if r.status.startswith("unsupported") else r.status
        per_round = ", ".join(f"{x:.2f}" for x in r.round_ratios)
        if len(r.round_ratios) > 6:
            per_round = (f"median {statistics.median(r.round_ratios):.2f}, range {min(r.round_ratios):.2f}–"
                         f"{max(r.round_ratios):.2f} ({len(r.round_ratios)} runs)")  # fmt: skip
        cpu_ms = "—" if r.cpu_median_ms is None else f"{r.cpu_median_ms:.2f}"
        cpu_ratio = _fmt_ratio(r.cpu_ratio) if r.cpu_ratio is not None else ("" if r.status == "ok" else "—")
        lines.append(
            f"| {r.model} | {r.batch} | {r.loop} | {r.label} | {len(r.times) or ''} | {ms} | {ratio} | {per_round} | "
            f"{_fmt_ratio(r.ratio_of_means) if r.ratio_of_means else ''} | {cpu_ms} | {cpu_ratio} | {target_text} | "
            f"{'; '.join(notes)} |"
        )
    return "\n".join(lines) + "\n"


def _fmt_load(load) -> str:
    return "/".join(f"{x:.2f}" for x in load)


def write_section(path: Path, section: str) -> None:
    """Replace (or append) the overhead section of ``path``, keeping every other section."""
    heading, _, body = section.partition("\n")
    assert heading == SECTION_HEADING
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    replace_section(str(path), heading, body.strip("\n"))


# ---------------------------------------------------------------------------------------------- profile


class _TimedCallback(GradientNoiseScaleCallback):
    """The callback with wall time spent in its per-step methods accumulated (for ``--profile``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spent: dict[str, float] = defaultdict(float)

    def _build_meter(self, trainer, pl_module, **kwargs):
        meter = super()._build_meter(trainer, pl_module, **kwargs)
        if meter.method == "micro_batch":  # its hook goes on each parameter at attach (after this): time it there
            on_grad = meter.collector._on_grad

            def timed_on_grad(*args, **kwargs):
                start = cpu_clock()
                try:
                    return on_grad(*args, **kwargs)
                finally:
                    self.spent["parameter hooks (micro_batch)"] += cpu_clock() - start

            meter.collector._on_grad = timed_on_grad
        return meter

    def _timed(self, name: str, *args):
        start = cpu_clock()
        try:
            return getattr(super(), name)(*args)
        finally:
            self.spent[name] += cpu_clock() - start

    def on_train_batch_start(self, *args):
        return self._timed("on_train_batch_start", *args)

    def on_before_optimizer_step(self, *args):
        return self._timed("on_before_optimizer_step", *args)


def _phase_times(step: PlainStep, pool: list, steps: int, warmup: int, pop: Callable | None) -> dict[str, float]:
    """Median ms of zero_grad+forward / backward (incl. hooks) / pop / optimizer step in the plain loop."""
    record: dict[str, list[float]] = defaultdict(list)
    for i in range(warmup + steps):
        x, y = pool[i % len(pool)]
        t0 = cpu_clock()
        step.optimizer.zero_grad(set_to_none=True)
        loss = step.spec.loss(step.net(x), y)
        t1 = cpu_clock()
        loss.backward()
        t2 = cpu_clock()
        if pop is not None:
            step.total += pop().sum()
        t3 = cpu_clock()
        step.optimizer.step()
        t4 = cpu_clock()
        if i >= warmup:
            for key, value in zip(("zero_grad + forward", "backward", "pop + sum", "optimizer step"),
                                  (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):  # fmt: skip
                record[key].append(value)
    return {key: 1000 * statistics.median(values) for key, values in record.items()}


def profile_per_example(quick: bool = False, threads: int = 1, models: list[str] | None = None,
                        steps: int = 15, warmup: int = 4) -> str:
    """Where the callback's time goes: per-layer hook functions, hook glue, callback methods, top ops.
    Times are CPU times (:data:`cpu_clock`), medians over steps."""
    _quiet()
    set_threads(threads)
    out = [f"### Profile of the per-example hooks and the callback (`torch.set_num_threads({threads})`, CPU time "
           f"`time.{cpu_clock.__name__}`)", ""]
    specs = [s for s in model_specs(quick) if models is None or s.name.lower() in {m.lower() for m in models}]
    with tempfile.TemporaryDirectory(prefix="gns_profile_") as workdir:
        for spec in specs:
            torch.manual_seed(0)
            template = spec.build()
            pool = batch_pool(spec)
            base = PlainStep(spec, copy.deepcopy(template))
            tracked = GnsTrackerStep(spec, copy.deepcopy(template))
            tracker = tracked.tracker
            layer_times: dict[str, list[float]] = defaultdict(list)
            shapes: dict[str, str] = {}
            for module, covered in list(tracker._covered_modules.items()):
                def timed(mod, inp, grad, *, param_names=None, fn=covered.sq_norms, name=covered.name):
                    start = cpu_clock()
                    with torch.profiler.record_function(f"gns::{type(mod).__name__}"):
                        result = fn(mod, inp, grad, param_names=param_names)
                    layer_times[name].append(cpu_clock() - start)
                    shapes[name] = f"{type(mod).__name__} in {tuple(inp.shape)} out {tuple(grad.shape)}"
                    return result

                tracker._covered_modules[module] = dataclasses.replace(covered, sq_norms=timed)
            for _ in range(2):  # keep the second, warmer pair
                layer_times.clear()
                base_phases = _phase_times(base, pool, steps, warmup, None)
                layer_times.clear()
                tracked_phases = _phase_times(tracked, pool, steps, warmup, tracker.pop)
            base_total, tracked_total = sum(base_phases.values()), sum(tracked_phases.values())
            out += [f"#### {spec.name} (batch {spec.batch}), plain loop: baseline {base_total:.2f} ms/step, with "
                    f"`PerExampleNormTracker` {tracked_total:.2f} ms/step ({tracked_total / base_total:.2f}×)", "",
                    "| phase | baseline ms | tracker ms |", "|---|---|---|"]  # fmt: skip
            out += [f"| {k} | {base_phases[k]:.2f} | {tracked_phases[k]:.2f} |" for k in base_phases]
            layer_ms = {name: 1000 * statistics.median(ts) for name, ts in layer_times.items()}
            backward_delta = tracked_phases["backward"] - base_phases["backward"]
            out += ["", "| covered module | shapes | ms/step in its norm function | % of baseline step |", "|---|---|---|---|"]
            out += [f"| {name} | {shapes[name]} | {ms:.2f} | {100 * ms / base_total:.1f}% |" for name, ms in layer_ms.items()]
            out += [f"| **sum** | | {sum(layer_ms.values()):.2f} | {100 * sum(layer_ms.values()) / base_total:.1f}% |",
                    f"| backward slow-down not in the norm functions (hook glue, autograd) | | "
                    f"{backward_delta - sum(layer_ms.values()):.2f} | |", ""]  # fmt: skip
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                for i in range(5):
                    x, y = pool[i % len(pool)]
                    tracked(x, y)
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
            out += ["Top ops of 5 tracker steps by `torch.profiler` self time (wall clock, so inflated when the machine "
                    "is shared; the whole step, hooks and model):", "",
                    "| op | self ms/step | calls/step |", "|---|---|---|"]  # fmt: skip
            out += [f"| `{e.key}` | {e.self_cpu_time_total / 1000 / 5:.2f} | {e.count / 5:g} |" for e in events]
            tracked.close()
            out.append("")
            for method, accumulate in (("per_example", 1), ("micro_batch", 4)):
                callback = _TimedCallback(method=method, verbose=False, report_path=os.path.join(workdir, "r.json"))
                run_steps = warmup + steps
                module = BenchModule(copy.deepcopy(template), spec.loss, pool, run_steps * accumulate)
                trainer = pl.Trainer(
                    accelerator="cpu", devices=1, max_epochs=1, max_steps=run_steps, accumulate_grad_batches=accumulate,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    callbacks=[callback], default_root_dir=workdir,
                )  # fmt: skip
                trainer.fit(module)
                spent = ", ".join(f"`{k}` {1000 * v / run_steps:.3f}" for k, v in callback.spent.items())
                out.append(f"- Lightning `{method}` (accumulate={accumulate}, callback defaults), CPU ms per "
                           f"optimizer step inside the callback's methods (per-example layer hooks not included; "
                           f"see the plain-loop table): {spent}")  # fmt: skip
            out.append("")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and few steps (smoke test, < 30 s)")
    parser.add_argument("--out", type=Path, help="write/replace the overhead section of this markdown file")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads value (default 1)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, help="untimed optimizer steps per run")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--budget", type=float, help="seconds one plain-loop run may take (slow peers are cut)")
    parser.add_argument("--models", nargs="+", help="subset of MLP CNN Transformer")
    parser.add_argument("--no-peers", action="store_true", help="skip torch-external peers (BackPACK, Opacus)")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the benchmark, print where the per-example time goes (per layer, per op)")
    args = parser.parse_args(argv)
    if args.profile:
        print(profile_per_example(quick=args.quick, threads=args.threads, models=args.models))
        return 0
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])
    run = run_benchmark(quick=args.quick, steps=args.steps, warmup=args.warmup, rounds=args.rounds,
                        threads=args.threads, peers=not args.no_peers, models=args.models,
                        budget_s=args.budget)  # fmt: skip
    section = render(run, command)
    print(section)
    if args.out:
        write_section(args.out, section)
        print(f"[overhead] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
