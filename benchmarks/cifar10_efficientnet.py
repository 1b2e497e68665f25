"""CIFAR-10 / EfficientNet-B0 / LAMB: baseline batch vs the batch size and learning rate that
``GradientNoiseScaleCallback`` recommends (the experiment of the blog post "Stop burning money on the wrong
batch size": batch 64 at LR 1e-3 vs the GNS-predicted batch 1024 at LR 7e-3).

One command runs three phases, each a fresh model from the same seed, each stopped at the target validation
accuracy or at its time budget, whichever comes first (phase 2: at ``--gns-steps`` or its time budget):

1. **baseline**: batch 64, LAMB at LR 1e-3;
2. **GNS measurement**: the same batch 64 as micro-batch 32 × ``accumulate_grad_batches=2`` with
   ``GradientNoiseScaleCallback(probe=True)``: EfficientNet has BatchNorm, so ``method="auto"`` resolves to
   ``micro_batch``, which needs two or more micro-batches per optimizer step. Runs ``--gns-steps`` optimizer steps
   (or its time budget) and yields B_simple, the probe (memory, throughput per micro-batch) and the
   recommendation;
3. **recommended**: the recommended global batch (as micro-batch × accumulation) and learning rate (square-root
   rule for LAMB), with a ``LinearLR`` warmup over ``warmup_steps`` optimizer steps when the recommendation has one.

Output: a table in the blog's shape (batch size, learning rate, training time, epochs, training accuracy,
validation accuracy, time to target), B_simple with its interval, throughput per micro-batch size from the probe
and peak memory; printed, and with ``--out`` written to the section "## CIFAR-10 EfficientNet-B0" of a results
file (``benchmarks/RESULTS.md``) with the hardware and the exact command.

    # real data (python version of CIFAR-10, extracted): https://www.cs.toronto.edu/~kriz/cifar.html
    python benchmarks/cifar10_efficientnet.py --data-dir ~/data/cifar10 --time-budget 2000 --out benchmarks/RESULTS.md
    # no data at hand: a synthetic CIFAR-shaped set (never reported as CIFAR-10); the recorded CPU run, ~5 min:
    python benchmarks/cifar10_efficientnet.py --synthetic --tiny --train-size 10000 --val-size 2000 \
        --time-budget 100 --gns-steps 300 --val-every 20 --target-acc 0.4 --memory-budget-gb 0.5 --threads 1 \
        --out benchmarks/RESULTS.md
    # CI smoke run (~15-30 s on 2 CPU cores): tiny model, tiny synthetic subset, a few steps per phase
    python benchmarks/cifar10_efficientnet.py --quick --synthetic

Model and optimizer: ``timm``'s ``efficientnet_b0`` and ``timm.optim.Lamb`` when ``timm`` imports, else the
plain-PyTorch versions in ``benchmarks/cifar10/`` (same architecture and parameter count, 4,020,358; LAMB per
You et al. 2019). Stem stride 1 for 32×32 inputs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
import tempfile
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import pytorch_lightning as pl  # noqa: E402

from benchmarks.cifar10 import data as cifar_data  # noqa: E402
from benchmarks.cifar10.lamb import build_lamb  # noqa: E402
from benchmarks.cifar10.model import build_model, count_parameters  # noqa: E402
from gns_callback import GradientNoiseScaleCallback  # noqa: E402

SECTION_HEADING = "## CIFAR-10 EfficientNet-B0"
REAL_SUBSECTION = "### Real CIFAR-10 data"
SYNTHETIC_SUBSECTION = "### SYNTHETIC data (not CIFAR-10)"
SYNTHETIC_GPU_SUBSECTION = "### SYNTHETIC data (not CIFAR-10), full-size EfficientNet-B0 on a GPU"
SCRIPT = "benchmarks/cifar10_efficientnet.py"
#: The blog's table (EfficientNet-B0 + LAMB on CIFAR-10), for reference in the output.
BLOG_ROWS = (
    (64, 1e-3, 1928, 21, 90.98, 67.67),
    (64, 1e-3, 7416, 82, 97.92, 70.68),
    (1024, 7e-3, 1914, 81, 98.64, 71.51),
)

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
warnings.filterwarnings("ignore", ".*predict_dataloader.*")


# ------------------------------------------------------------------------------------------------ module
class CifarModule(pl.LightningModule):
    """Classifier on uint8 CIFAR batches: augmentation (training only) and normalisation on the device."""

    def __init__(self, model: torch.nn.Module, lr: float, *, weight_decay: float = 0.01, impl: str = "auto",
                 warmup_steps: int = 0, warmup_start_factor: Optional[float] = None, train_window: int = 50_000):
        super().__init__()
        self.model = model
        self.lr = lr
        self.weight_decay = weight_decay
        self.impl = impl
        self.warmup_steps = int(warmup_steps or 0)
        self.warmup_start_factor = warmup_start_factor
        self.optimizer_description = ""
        # training accuracy over the last `train_window` training examples (one epoch's worth), kept on device
        self._train_window = train_window
        self._train_hits: deque = deque()
        self._train_seen = 0
        self._val_correct = torch.zeros(())
        self._val_total = 0

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        if x.dtype == torch.uint8:
            if self.trainer is not None and self.trainer.training:
                x = cifar_data.augment(x)
            x = cifar_data.normalize(x)
        return x, y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        hits = (logits.detach().argmax(1) == y).sum()
        self._train_hits.append((hits, y.shape[0]))
        self._train_seen += y.shape[0]
        while self._train_seen - self._train_hits[0][1] >= self._train_window:
            self._train_seen -= self._train_hits.popleft()[1]
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def reset_train_accuracy(self) -> None:
        self._train_hits.clear()
        self._train_seen = 0

    def train_accuracy(self) -> Optional[float]:
        if not self._train_hits:
            return None
        return float(sum(h for h, _ in self._train_hits)) / sum(n for _, n in self._train_hits)

    def on_validation_epoch_start(self) -> None:
        self._val_correct = torch.zeros((), device=self.device)
        self._val_total = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self._val_correct += (self.model(x).argmax(1) == y).sum()
        self._val_total += y.shape[0]

    def on_validation_epoch_end(self) -> None:
        if self._val_total:
            self.log("val_acc", self._val_correct / self._val_total, prog_bar=True)

    def configure_optimizers(self):
        optimizer, self.optimizer_description = build_lamb(self.model, self.lr, weight_decay=self.weight_decay,
                                                           impl=self.impl)
        if self.warmup_steps > 0:
            start = self.warmup_start_factor if self.warmup_start_factor else 1.0 / self.warmup_steps
            scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=min(max(start, 1e-8), 1.0),
                                                          end_factor=1.0, total_iters=self.warmup_steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        return optimizer


# ------------------------------------------------------------------------------------------------ stopping
class PhaseClock(pl.Callback):
    """Stops the phase at the target validation accuracy (optional) or when its time budget is spent, and keeps
    the timeline: wall time from the first training batch, validation results, time to target.

    Time spent in ``GradientNoiseScaleCallback``'s probe (measured between this callback's and
    :class:`ProbeEnd`'s ``on_train_batch_start`` on the first batch) is reported separately and not charged to
    the budget."""

    def __init__(self, time_budget: float, target_acc: Optional[float], stop_at_target: bool = True,
                 max_steps: Optional[int] = None) -> None:
        self.time_budget = time_budget
        self.max_steps = max_steps
        self.target_acc = target_acc
        self.stop_at_target = stop_at_target
        self.start: Optional[float] = None
        self.end: Optional[float] = None
        self.probe_seconds = 0.0
        self._probe_started: Optional[float] = None
        self.time_to_target: Optional[float] = None
        self.epochs_to_target: Optional[float] = None
        self.stopped_by = "max epochs/steps"
        self.validations: list[dict[str, float]] = []
        self.examples = 0

    def elapsed(self) -> float:
        if self.start is None:
            return 0.0
        return (self.end or time.perf_counter()) - self.start - self.probe_seconds

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.start is None:
            self._sync(pl_module)
            self.start = time.perf_counter()
            self._probe_started = self.start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.examples += int(batch[1].shape[0])
        if trainer.should_stop:
            return
        # Setting should_stop here (rather than Trainer(max_steps=...)) makes Lightning validate once more.
        if self.max_steps and trainer.global_step >= self.max_steps:
            self.stopped_by = f"{self.max_steps} optimizer steps"
            trainer.should_stop = True
        elif self.time_budget and self.elapsed() >= self.time_budget:
            self.stopped_by = "time budget"
            trainer.should_stop = True

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or "val_acc" not in trainer.callback_metrics:
            return
        self._sync(pl_module)
        acc = float(trainer.callback_metrics["val_acc"])
        now = self.elapsed()
        epochs = self.examples / max(1, len(trainer.train_dataloader.dataset))
        self.validations.append({"seconds": now, "epochs": epochs, "step": trainer.global_step, "val_acc": acc})
        if self.target_acc is not None and acc >= self.target_acc and self.time_to_target is None:
            self.time_to_target, self.epochs_to_target = now, epochs
            if self.stop_at_target:
                self.stopped_by = "target reached"
                trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._sync(pl_module)
        self.end = time.perf_counter()


class ProbeEnd(pl.Callback):
    """Placed after ``GradientNoiseScaleCallback``: marks the end of its probe on the first training batch."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock
        self.done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.done and self.clock._probe_started is not None:
            self.done = True
            self.clock.probe_seconds = time.perf_counter() - self.clock._probe_started
            pl_module.reset_train_accuracy()  # the probe ran training_step on tiled batches: not training
            if pl_module.device.type == "cuda":  # the phase's peak memory: training, not the probe's largest trial
                torch.cuda.reset_peak_memory_stats(pl_module.device)


# ------------------------------------------------------------------------------------------------ results
@dataclass
class PhaseResult:
    name: str
    batch_size: int
    micro_batch_size: int
    accumulate: int
    lr: float
    warmup_steps: int
    train_seconds: float
    epochs: float
    steps: int
    examples: int
    train_acc: Optional[float]
    val_acc: Optional[float]
    time_to_target: Optional[float]
    epochs_to_target: Optional[float]
    stopped_by: str
    samples_per_s: float
    probe_seconds: float = 0.0
    peak_memory_bytes: Optional[int] = None
    memory_source: str = ""
    validations: list[dict[str, float]] = field(default_factory=list)


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None or not math.isfinite(n):
        return "–"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _fmt_seconds(s: Optional[float]) -> str:
    return "not reached" if s is None else f"{s:,.0f} s" if s >= 100 else f"{s:.1f} s"


def _fmt_pct(v: Optional[float]) -> str:
    return "–" if v is None else f"{100 * v:.2f} %"


def _fmt_num(v: Optional[float], digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    return f"{v:.{digits}g}"


# ------------------------------------------------------------------------------------------------ arguments
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"python {SCRIPT}",
        description="CIFAR-10 EfficientNet-B0 + LAMB: baseline vs the GNS-recommended batch size and learning rate.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data")
    d.add_argument("--data-dir", default="data/cifar10",
                   help="folder with cifar-10-batches-py/ (or the six batch files themselves)")
    d.add_argument("--download", action="store_true", help=f"download {cifar_data.CIFAR10_URL} into --data-dir "
                   "if the files are missing (md5 checked)")
    d.add_argument("--synthetic", action="store_true", help="use a synthetic CIFAR-shaped data set (not CIFAR-10)")
    d.add_argument("--train-size", type=int, default=None, help="use the first N training images (default: all; "
                   "synthetic: 50000)")
    d.add_argument("--val-size", type=int, default=None, help="use the first N test images (default: all; "
                   "synthetic: 10000)")
    m = p.add_argument_group("model and optimizer")
    m.add_argument("--impl", choices=["auto", "timm", "builtin"], default="auto",
                   help="timm's efficientnet_b0/Lamb (auto: when timm imports) or the built-in fallbacks")
    m.add_argument("--width-mult", type=float, default=1.0, help="channel multiplier (1: B0)")
    m.add_argument("--depth-mult", type=float, default=1.0, help="repeat multiplier (1: B0)")
    m.add_argument("--tiny", action="store_true", help="width ×0.25, depth ×0.25 (127k parameters) for CPU runs")
    m.add_argument("--dropout", type=float, default=0.2)
    m.add_argument("--drop-path", type=float, default=0.2, help="stochastic depth rate of the last block")
    m.add_argument("--weight-decay", type=float, default=0.01, help="LAMB weight decay (conv/linear weights only)")
    t = p.add_argument_group("phases")
    t.add_argument("--batch-size", type=int, default=None, help="baseline batch size, phases 1 and 2 (default 64; "
                   "--quick: 32)")
    t.add_argument("--lr", type=float, default=1e-3, help="baseline learning rate (phases 1 and 2)")
    t.add_argument("--target-acc", type=float, default=0.70, help="stop a phase at this validation accuracy")
    t.add_argument("--time-budget", type=float, default=None, help="seconds of training per phase (default 1800; "
                   "--quick: 3)")
    t.add_argument("--max-epochs", type=int, default=1000)
    t.add_argument("--val-every", type=float, default=None, help="validate every this many seconds of training, "
                   "and when a phase stops (default 30; --quick: 2)")
    t.add_argument("--gns-micro-batch", type=int, default=None, help="phase 2 micro-batch (default: batch / "
                   "accumulate)")
    t.add_argument("--gns-accumulate", type=int, default=None, help="phase 2 accumulate_grad_batches, ≥ 2 (default 2)")
    t.add_argument("--gns-steps", type=int, default=None, help="phase 2 length in optimizer steps (default 1000; "
                   "--quick: 20)")
    t.add_argument("--gns-time-budget", type=float, default=None, help="phase 2 time budget (default: --time-budget; "
                   "--quick: 6)")
    t.add_argument("--memory-budget-gb", type=float, default=None,
                   help="the probe's memory budget (default: the GPU's memory; on CPU 1 GiB, which keeps the probe "
                   "short; --quick: 1/16 GiB)")
    t.add_argument("--max-batch-size", type=int, default=None, help="upper bound for the recommended batch")
    t.add_argument("--skip-baseline", action="store_true", help="run phases 2 and 3 only")
    r = p.add_argument_group("run")
    r.add_argument("--accelerator", default="auto")
    r.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed on a GPU")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice; "
                   "--quick: 1, steadier on a shared CPU)")
    r.add_argument("--quick", action="store_true", help="CI smoke run (~30 s on 2 CPU cores): tiny model with the "
                   "original stride-2 stem, 512/256 images, batch 32 (phase 2: 16 × 2), 20 GNS steps, 3 s per phase "
                   "(GNS phase 6 s), one thread, no progress bars")
    r.add_argument("--no-progress", action="store_true", help="no progress bars (off anyway with --quick)")
    r.add_argument("--work-dir", default=None, help="Lightning logs and the GNS report (default: a temp dir)")
    r.add_argument("--out", default=None, help="write the results section into this markdown file "
                   "(e.g. benchmarks/RESULTS.md); other sections are kept")
    r.add_argument("--json", default=None, help="also write the results as JSON here (always written to "
                   "<work-dir>/result.json)")
    r.add_argument("--from-json", default=None, help="no training: render a saved result.json (its own command, "
                   "date and hardware) into --out")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    if args.tiny:
        args.width_mult, args.depth_mult = 0.25, 0.25
    args.stem_stride = 1
    quick = args.quick
    if quick:
        args.width_mult, args.depth_mult, args.stem_stride = 0.25, 0.25, 2
        args.train_size = args.train_size or 512
        args.val_size = args.val_size or 256
        args.no_progress = True
        if args.threads is None:
            args.threads = 1
    defaults = {  # name: (normal, --quick)
        "batch_size": (64, 32),
        "time_budget": (1800.0, 3.0),
        "val_every": (30.0, 2.0),
        "gns_accumulate": (2, 2),
        "gns_steps": (1000, 20),
        "memory_budget_gb": (None, 1 / 16),
        "gns_time_budget": (None, 6.0),
    }
    for name, (normal, small) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if quick else normal)
    if args.gns_accumulate < 2:
        p.error("--gns-accumulate must be ≥ 2: EfficientNet has BatchNorm, so the callback measures with "
                "method='micro_batch', which compares the micro-batches of one optimizer step")
    if args.gns_micro_batch is None:
        args.gns_micro_batch = max(1, args.batch_size // args.gns_accumulate)
    if args.gns_time_budget is None:
        args.gns_time_budget = args.time_budget
    if args.memory_budget_gb is None and (args.accelerator == "cpu" or not torch.cuda.is_available()):
        args.memory_budget_gb = 1.0  # CPU: the probe's largest trial stays affordable
    return args


# ------------------------------------------------------------------------------------------------ data
def load_data(args: argparse.Namespace, log) -> dict[str, Any]:
    if args.synthetic:
        n_train = args.train_size or 50_000
        n_val = args.val_size or 10_000
        (xt, yt), (xv, yv) = cifar_data.synthetic_cifar10(n_train, n_val, seed=args.seed)
        source = (f"SYNTHETIC CIFAR-shaped data ({n_train} train / {n_val} val images, 10 classes, seed {args.seed}; "
                  "benchmarks/cifar10/data.py:synthetic_cifar10) — NOT CIFAR-10")
        return {"train": (xt, yt), "val": (xv, yv), "synthetic": True, "source": source}
    if args.download:
        log(f"Downloading CIFAR-10 into {args.data_dir} (if missing) ...")
        cifar_data.download_cifar10(args.data_dir)
    (xt, yt), (xv, yv) = cifar_data.load_cifar10(args.data_dir)
    if args.train_size:
        xt, yt = xt[: args.train_size], yt[: args.train_size]
    if args.val_size:
        xv, yv = xv[: args.val_size], yv[: args.val_size]
    source = f"CIFAR-10 from {args.data_dir} ({len(xt)} train / {len(xv)} test images)"
    return {"train": (xt, yt), "val": (xv, yv), "synthetic": False, "source": source}


# ------------------------------------------------------------------------------------------------ one phase
def _trainer(args: argparse.Namespace, work_dir: Path, name: str, callbacks: list, *, accumulate: int) -> pl.Trainer:
    return pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_epochs=args.max_epochs,
        accumulate_grad_batches=accumulate,
        val_check_interval=datetime.timedelta(seconds=args.val_every),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        default_root_dir=str(work_dir / name),
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=not args.no_progress,
        log_every_n_steps=10,
    )


def _new_module(args: argparse.Namespace, lr: float, train_size: int, warmup_steps: int = 0,
                warmup_start_factor: Optional[float] = None) -> tuple[CifarModule, str]:
    pl.seed_everything(args.seed, verbose=False)  # every phase starts from the same initial weights
    model, description = build_model(10, width_mult=args.width_mult, depth_mult=args.depth_mult,
                                     dropout=args.dropout, drop_path_rate=args.drop_path, impl=args.impl)
    if args.stem_stride != 1:
        stem = getattr(model, "stem", None)
        conv = stem[0] if stem is not None else model.conv_stem
        conv.stride = (args.stem_stride, args.stem_stride)
        description = description.replace("stem stride 1 for 32×32", f"stem stride {args.stem_stride}, --quick")
    module = CifarModule(model, lr, weight_decay=args.weight_decay, impl=args.impl, warmup_steps=warmup_steps,
                         warmup_start_factor=warmup_start_factor, train_window=train_size)
    return module, description


def _peak_memory(device: torch.device) -> Optional[int]:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def run_phase(args, data, work_dir: Path, name: str, *, micro: int, accumulate: int, lr: float,
              time_budget: float, warmup_steps: int = 0, warmup_start_factor: Optional[float] = None,
              stop_at_target: bool = True, max_steps: int = -1,
              gns: Optional[GradientNoiseScaleCallback] = None, log=print) -> tuple[PhaseResult, CifarModule]:
    (xt, yt), (xv, yv) = data["train"], data["val"]
    module, _ = _new_module(args, lr, len(xt), warmup_steps, warmup_start_factor)
    clock = PhaseClock(time_budget, args.target_acc, stop_at_target=stop_at_target,
                       max_steps=max_steps if max_steps > 0 else None)
    callbacks: list = [clock]
    if gns is not None:
        callbacks += [gns, ProbeEnd(clock)]
    trainer = _trainer(args, work_dir, name, callbacks, accumulate=accumulate)
    if torch.cuda.is_initialized() and trainer.strategy.root_device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)
    train_loader = cifar_data.loader(xt, yt, micro, train=True, seed=args.seed)
    val_loader = cifar_data.loader(xv, yv, 500, train=False)
    trainer.fit(module, train_loader, val_loader)
    seconds = clock.elapsed()
    val_acc = clock.validations[-1]["val_acc"] if clock.validations else None
    peak = _peak_memory(trainer.strategy.root_device)
    result = PhaseResult(
        name=name,
        batch_size=micro * accumulate,
        micro_batch_size=micro,
        accumulate=accumulate,
        lr=lr,
        warmup_steps=warmup_steps,
        train_seconds=seconds,
        epochs=clock.examples / len(xt),
        steps=trainer.global_step,
        examples=clock.examples,
        train_acc=module.train_accuracy(),
        val_acc=val_acc,
        time_to_target=clock.time_to_target,
        epochs_to_target=clock.epochs_to_target,
        stopped_by=clock.stopped_by,
        samples_per_s=clock.examples / seconds if seconds > 0 else float("nan"),
        probe_seconds=clock.probe_seconds,
        peak_memory_bytes=peak,
        memory_source="torch.cuda.max_memory_allocated" if peak is not None else "",
        validations=clock.validations,
    )
    log(f"[{name}] {result.steps} optimizer steps, {result.epochs:.2f} epochs in {seconds:.1f} s "
        f"({result.samples_per_s:.0f} samples/s), val acc {_fmt_pct(val_acc)}, stopped by {clock.stopped_by}"
        + (f"; probe {clock.probe_seconds:.1f} s (not counted)" if gns is not None else ""))
    return result, module


def _modelled_bytes(probe, micro: int) -> Optional[float]:
    if probe is None or probe.fixed_bytes is None or probe.bytes_per_sample is None:
        return None
    return probe.fixed_bytes + probe.bytes_per_sample * micro


# ------------------------------------------------------------------------------------------------ the benchmark
def recommended_settings(rec: Any, args: argparse.Namespace) -> tuple[int, int, float, int, Optional[float]]:
    """Phase 3's ``(micro_batch, accumulate, lr, warmup_steps, warmup_start_factor)`` from the recommendation
    (followed whatever its status: an untrusted one keeps the global batch, possibly split differently); the
    baseline's settings when there is none."""
    if rec is None:
        return args.batch_size, 1, args.lr, 0, None
    lr = rec.learning_rate if rec.learning_rate is not None else args.lr
    warmup = int(rec.warmup_steps or 0)
    start = rec.warmup_start_factor if warmup else None
    return rec.micro_batch_size, rec.accumulate_grad_batches, lr, warmup, start


def _load_average() -> str:
    try:
        return "%.2f/%.2f/%.2f" % os.getloadavg()
    except OSError:
        return "?"


def run_benchmark(args: argparse.Namespace, log=print) -> dict[str, Any]:
    started = time.perf_counter()
    load_at_start = _load_average()
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="gns_cifar10_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    data = load_data(args, log)
    n_train = len(data["train"][0])
    counted, model_description = _new_module(args, args.lr, n_train)
    n_params = count_parameters(counted.model)
    del counted
    log(f"Work dir: {work_dir}")
    log(f"Data: {data['source']}")
    log(f"Model: {model_description}, {n_params:,} parameters")

    phases: list[PhaseResult] = []
    # 1. baseline
    if not args.skip_baseline:
        log(f"\nPhase 1/3 — baseline: batch {args.batch_size}, LAMB lr {args.lr:g}, until val acc ≥ "
            f"{args.target_acc:.0%} or {args.time_budget:g} s")
        base, module = run_phase(args, data, work_dir, "baseline", micro=args.batch_size, accumulate=1, lr=args.lr,
                                 time_budget=args.time_budget, log=log)
        optimizer_description = module.optimizer_description
        phases.append(base)

    # 2. GNS measurement
    gns_micro, gns_acc = args.gns_micro_batch, args.gns_accumulate
    budget = int(args.memory_budget_gb * 2**30) if args.memory_budget_gb else None
    log(f"\nPhase 2/3 — GNS measurement: EfficientNet has BatchNorm, so method='auto' uses 'micro_batch', which "
        f"needs accumulate_grad_batches ≥ 2: micro-batch {gns_micro} × accumulate {gns_acc} = global "
        f"{gns_micro * gns_acc}, lr {args.lr:g}, {args.gns_steps} optimizer steps or {args.gns_time_budget:g} s; "
        f"probe on (memory budget {'the device memory' if budget is None else _fmt_bytes(budget)})")
    report_path = work_dir / "gns_report.json"
    gns = GradientNoiseScaleCallback(
        method="auto", ema_decay=0.95, log_every_n_steps=5 if args.quick else 10, report_path=str(report_path),
        verbose=not args.quick, probe=True, memory_budget_bytes=budget, headroom=0.85, recommend=True,
        max_batch_size=args.max_batch_size,
    )
    measure, module = run_phase(args, data, work_dir, "GNS measurement", micro=gns_micro, accumulate=gns_acc,
                                lr=args.lr, time_budget=args.gns_time_budget, stop_at_target=False,
                                max_steps=args.gns_steps, gns=gns, log=log)
    if args.skip_baseline:
        optimizer_description = module.optimizer_description
    phases.append(measure)
    est, run_est, rec, probe = gns.estimate, gns.run_estimate, gns.recommendation, gns.probe
    log(f"  B_simple (run average) = {run_est}")
    log(f"  B_simple (recent, EMA) = {est}")
    if probe is not None:
        log(f"  {probe.summary()}")
    if rec is not None:
        log(rec.summary_table())

    # 3. recommended
    micro, accumulate, lr, warmup, start_factor = recommended_settings(rec, args)
    log(f"\nPhase 3/3 — recommended: batch {micro * accumulate} (micro {micro} × accumulate {accumulate}), lr "
        f"{lr:.4g}" + (f", LinearLR warmup over {warmup} steps from ×{start_factor or 1 / warmup:.3g}" if warmup else "")
        + (f" [recommendation status: {rec.status}]" if rec is not None else " [no recommendation]"))
    final, _ = run_phase(args, data, work_dir, "recommended", micro=micro, accumulate=accumulate, lr=lr,
                         time_budget=args.time_budget, warmup_steps=warmup, warmup_start_factor=start_factor, log=log)
    phases.append(final)

    for phase in phases:  # CPU: the probe's memory model at each phase's micro-batch
        if phase.peak_memory_bytes is None:
            modelled = _modelled_bytes(probe, phase.micro_batch_size)
            if modelled is not None:
                phase.peak_memory_bytes = int(modelled)
                phase.memory_source = "probe model (fixed + per-sample × micro-batch)"

    result = {
        "phases": phases,
        "estimate": est.to_dict(),
        "run_estimate": run_est.to_dict(),
        "recommendation": rec.to_dict() if rec is not None else None,
        "recommendation_table": rec.summary_table() if rec is not None else None,
        "probe": probe.to_dict() if probe is not None else None,
        "probe_summary": probe.summary() if probe is not None else None,
        "synthetic": data["synthetic"],
        "data_source": data["source"],
        "model": model_description,
        "parameters": n_params,
        "optimizer": optimizer_description,
        "hardware": hardware_description() + (f"; torch threads {torch.get_num_threads()}; load average (1/5/15 min) "
                                              f"{load_at_start} at start, {_load_average()} at end (shared machine)"),
        "command": "python " + SCRIPT + (" " + shlex.join(args.argv) if args.argv else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "total_seconds": time.perf_counter() - started,
        "report_path": str(report_path),
        "work_dir": str(work_dir),
        "settings": {k: v for k, v in vars(args).items() if k != "argv"},
    }
    return result


def hardware_description() -> str:
    import pytorch_lightning

    cpu_name = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu_name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu_name)
    except OSError:
        pass
    parts = [f"{platform.machine()}, {os.cpu_count()} cores ({cpu_name})"]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name(0)}")
    else:
        parts.append("no GPU")
    try:
        import timm

        timm_version = f"timm {timm.__version__}"
    except Exception:
        timm_version = "timm not importable (built-in fallbacks)"
    return (f"{'; '.join(parts)}; Python {platform.python_version()}, torch {torch.__version__}, "
            f"pytorch-lightning {pytorch_lightning.__version__}, {timm_version}")


# ------------------------------------------------------------------------------------------------ rendering
def render_table(result: dict[str, Any], target_acc: float) -> str:
    head = ("| phase | batch size (micro × accumulate) | learning rate | warmup steps | training time | # epochs | "
            "optimizer steps | training accuracy | validation accuracy | time to target "
            f"({target_acc:.0%}) | stopped by | samples/s | peak memory |")
    lines = [head, "|" + "---|" * 13]
    for r in map(_phase, result["phases"]):
        lines.append(
            f"| {r.name} | {r.batch_size} ({r.micro_batch_size} × {r.accumulate}) | {r.lr:.4g} | {r.warmup_steps} | "
            f"{_fmt_seconds(r.train_seconds)} | {r.epochs:.2f} | {r.steps} | {_fmt_pct(r.train_acc)} | "
            f"{_fmt_pct(r.val_acc)} | {_fmt_seconds(r.time_to_target)} | {r.stopped_by} | {r.samples_per_s:,.0f} | "
            f"{_fmt_bytes(r.peak_memory_bytes)} |"
        )
    return "\n".join(lines)


def render_probe(result: dict[str, Any]) -> str:
    probe = result.get("probe")
    if not probe:
        return "Probe: not run."
    fixed, per = probe.get("fixed_bytes"), probe.get("bytes_per_sample")
    lines = [
        f"Probe ({probe['device']}, {probe['measure']}): max micro-batch {probe['max_micro_batch']} within "
        f"{probe['headroom']:g} × {_fmt_bytes(probe['budget_bytes'])}; memory ≈ {_fmt_bytes(fixed)} + "
        f"{_fmt_bytes(per)}/sample.",
        "",
        "| micro-batch | samples/s (probe) | modelled memory |",
        "|---|---|---|",
    ]
    for row in probe.get("throughput", []):
        size, sps = row["size"], row["samples_per_s"]
        mem = None if fixed is None or per is None else fixed + per * size
        lines.append(f"| {size} | {_fmt_num(sps, 4)} | {_fmt_bytes(mem)} |")
    return "\n".join(lines)


def _upper(est: dict[str, Any], name: str) -> Optional[float]:
    """A report value where ``null`` means unbounded once steps were measured."""
    value = est.get(name)
    return (math.inf if est.get("steps") else None) if value is None else value


def subsection_title(result: dict[str, Any]) -> str:
    """Real data; synthetic data on a GPU (full size); synthetic data elsewhere (the small CPU record)."""
    if not result["synthetic"]:
        return REAL_SUBSECTION
    return SYNTHETIC_GPU_SUBSECTION if "GPU " in result["hardware"] else SYNTHETIC_SUBSECTION


def render_section_body(result: dict[str, Any], target_acc: float) -> str:
    """The subsection for this run (real or synthetic data)."""
    run = result["run_estimate"]
    ema = result["estimate"]
    rec = result.get("recommendation")
    synthetic = result["synthetic"]
    lines = [subsection_title(result), ""]
    if synthetic:
        lines += [
            "**SYNTHETIC data, not CIFAR-10.** These numbers show that the three phases run end to end and that "
            "the model learns; they say nothing about CIFAR-10 accuracy or about the blog's result.",
            "",
        ]
    lines += [
        f"- Command: `{result['command']}`",
        f"- Date: {result['date']}; total wall time {result['total_seconds']:.0f} s",
        f"- Hardware: {result['hardware']}",
        f"- Data: {result['data_source']}",
        f"- Model: {result['model']}, {result['parameters']:,} parameters; optimizer: {result['optimizer']}",
        "- Each phase starts from the same initial weights (same seed) and stops at the target validation accuracy "
        "or its time budget; training time is wall time from the first batch, periodic validation included, the "
        "GNS probe excluded. Epochs = training examples seen / training set size. Training accuracy: the last "
        "epoch's worth of training batches (augmented, dropout on). Constant LR after warmup.",
        "",
        render_table(result, target_acc),
        "",
        f"- B_simple (run average over phase 2, used for the recommendation): **{_fmt_num(_upper(run, 'b_simple'))}** "
        f"(95% CI {_fmt_num(run.get('ci_low'))} – {_fmt_num(_upper(run, 'ci_high'))}; {run.get('steps')} steps, "
        f"method {run.get('method')}); recent (EMA, decay 0.95): {_fmt_num(_upper(ema, 'b_simple'))} "
        f"(95% CI {_fmt_num(ema.get('ci_low'))} – {_fmt_num(_upper(ema, 'ci_high'))}).",
    ]
    if rec is not None:
        lines.append(
            f"- Recommendation: batch {rec['batch_size']} (micro {rec['micro_batch_size']} × accumulate "
            f"{rec['accumulate_grad_batches']}), lr {_fmt_num(rec.get('learning_rate'))} ({rec['lr_rule']} rule), "
            f"warmup {rec.get('warmup_steps') or 0} steps; status `{rec['status']}`: {rec['reason']}."
        )
    else:
        lines.append("- Recommendation: none (no estimate); phase 3 repeated the baseline settings.")
    lines.append(f"- {_comparison(result)}")
    check = _prediction_check(result)
    if check:
        lines.append(f"- {check}")
    lines += ["", render_probe(result)]
    sources = sorted({_phase(p).memory_source for p in result["phases"] if _phase(p).memory_source})
    if sources:
        lines += ["", f"Peak memory column: {'; '.join(sources)}."]
    return "\n".join(lines)


def _baseline_and_recommended(result: dict[str, Any]) -> tuple[Optional[PhaseResult], Optional[PhaseResult]]:
    """Phases 1 and 3 of a result (``None`` where a phase did not run)."""
    phases = {p.name: p for p in map(_phase, result["phases"])}
    return phases.get("baseline"), phases.get("recommended")


def _prediction_check(result: dict[str, Any]) -> Optional[str]:
    """What the recommendation predicted for phase 3 over the baseline (steps, examples, time to the same loss
    under the empirical model) beside what phase 3 measured to the target; ``None`` unless both reached it."""
    base, final = _baseline_and_recommended(result)
    rec = result.get("recommendation")
    if rec is None or base is None or final is None or None in (base.time_to_target, final.time_to_target):
        return None
    current, new = rec["current"], rec["recommended"]
    if not (current.get("steps_factor") and new.get("steps_factor")) or rec.get("time_to_target_ratio") is None:
        return None
    steps = new["steps_factor"] / current["steps_factor"]
    examples = new["examples_factor"] / current["examples_factor"]
    return (f"Predicted by the recommendation (empirical model at B_noise {rec['b_noise']:.4g}) against measured to "
            f"the target: optimizer steps ×{steps:.3g} predicted, ×{final.steps / base.steps:.3g} measured; "
            f"examples ×{examples:.3g} predicted, ×{final.examples / base.examples:.3g} measured; time "
            f"×{rec['time_to_target_ratio']:.3g} predicted, ×{final.time_to_target / base.time_to_target:.3g} "
            "measured.")


def _comparison(result: dict[str, Any]) -> str:
    """One sentence: what phase 3 ran and how its time to target compares with the baseline's."""
    base, final = _baseline_and_recommended(result)
    rec = result.get("recommendation")
    every = result.get("settings", {}).get("val_every")
    grain = f" (times to target are resolved to the validation interval, {every:g} s)" if every else ""
    if final is None:
        return "Phase 3 did not run."
    if rec is not None and rec["status"] not in ("ok", "within_interval", "toward_interval"):
        what = (f"The recommendation was not trusted (`{rec['status']}`), so phase 3 kept the global batch "
                f"{final.batch_size} and LR {final.lr:g} (split {final.micro_batch_size} × {final.accumulate}): it "
                "repeats the baseline")
    else:
        what = f"Phase 3 ran the recommended batch {final.batch_size} at LR {final.lr:.4g}"
    if base is None:
        return what + "."
    if base.time_to_target is not None and final.time_to_target is not None:
        return (f"{what}; time to target {_fmt_seconds(final.time_to_target)} vs the baseline's "
                f"{_fmt_seconds(base.time_to_target)} ({base.time_to_target / final.time_to_target:.2f}× "
                f"speed-up){grain}.")
    return (f"{what}; time to target {_fmt_seconds(final.time_to_target)} vs the baseline's "
            f"{_fmt_seconds(base.time_to_target)}; final validation accuracy {_fmt_pct(final.val_acc)} vs "
            f"{_fmt_pct(base.val_acc)}{grain}.")


def _phase(p: Any) -> PhaseResult:
    return p if isinstance(p, PhaseResult) else PhaseResult(**p)


def _intro(has_real: bool) -> str:
    blog = "\n".join(
        f"| {b} | {lr:g} | {t} s | {e} | {ta:.2f} % | {va:.2f} % |" for b, lr, t, e, ta, va in BLOG_ROWS
    )
    lines = [
        f"Command: `python {SCRIPT} --data-dir <cifar-10-batches-py parent> --time-budget 2000 --out "
        "benchmarks/RESULTS.md` (three phases: baseline batch 64 at LAMB lr 1e-3; a GNS measurement with "
        "`GradientNoiseScaleCallback(probe=True)` at micro 32 × accumulate 2; the recommended batch and lr). "
        "The blog's table (EfficientNet-B0 + LAMB on CIFAR-10, its hardware):",
        "",
        "| batch size | learning rate | training time | # epochs | training accuracy | validation accuracy |",
        "|---|---|---|---|---|---|",
        blog,
    ]
    if not has_real:
        lines += ["", "**Real CIFAR-10: not run.** The machines this was measured on cannot download it (no "
                  "internet), so the records below are on SYNTHETIC CIFAR-shaped data: full-size on a GPU, and a "
                  "small model on the CPU."]
    return "\n".join(lines)


def write_section(path: str | Path, result: dict[str, Any], target_acc: float) -> None:
    """Replace this run's subsection (real or synthetic) of "## CIFAR-10 EfficientNet-B0" in ``path``, keeping
    the other subsection and every other section of the file."""
    from benchmarks.results import replace_section

    path = Path(path)
    subsections: dict[str, str] = {}
    if path.exists():
        lines = path.read_text().splitlines()
        if SECTION_HEADING in lines:
            start = lines.index(SECTION_HEADING) + 1
            end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
            current = None
            for line in lines[start:end]:
                if line.startswith("### "):
                    current = line.strip()
                    subsections[current] = ""
                elif current is not None:
                    subsections[current] += line + "\n"
            subsections = {k: (k + "\n" + v).strip("\n") for k, v in subsections.items()}
    body = render_section_body(result, target_acc)
    subsections[subsection_title(result)] = body
    known = [REAL_SUBSECTION, SYNTHETIC_GPU_SUBSECTION, SYNTHETIC_SUBSECTION]
    order = known + [k for k in subsections if k not in known]
    parts = [_intro(REAL_SUBSECTION in subsections)] + [subsections[k] for k in order if k in subsections]
    replace_section(str(path), SECTION_HEADING, "\n\n".join(parts))


def _jsonable(result: dict[str, Any]) -> dict[str, Any]:
    out = dict(result)
    out["phases"] = [asdict(p) for p in result["phases"]]

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return clean(out)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    log = print
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        target = result["settings"]["target_acc"]
        print(render_table(result, target))
        if args.out:
            write_section(args.out, result, target)
            print(f"\nResults written to {args.out} (section '{SECTION_HEADING}').")
        return result
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run_benchmark(args, log)
    except cifar_data.DataMissing as err:
        raise SystemExit(f"error: {err}") from None
    finally:
        torch.set_num_threads(threads)
    table = render_table(result, args.target_acc)
    print()
    if result["synthetic"]:
        print("*** SYNTHETIC data (not CIFAR-10): the numbers below say nothing about CIFAR-10 accuracy. ***")
    print(table)
    print()
    print(render_probe(result))
    if args.out:
        write_section(args.out, result, args.target_acc)
        print(f"\nResults written to {args.out} (section '{SECTION_HEADING}').")
    saved = json.dumps(_jsonable(result), indent=2)
    Path(result["work_dir"], "result.json").write_text(saved)
    if args.json:
        Path(args.json).write_text(saved)
    print(f"Result JSON: {Path(result['work_dir'], 'result.json')}; GNS report: {result['report_path']}")
    return result


if __name__ == "__main__":
    main()
