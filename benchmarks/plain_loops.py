"""Plain PyTorch loops a newcomer writes from the README, each measured by ``GradientNoiseScaleMeter`` against the
exact ``B_simple`` (brute force over the whole data set, ``gns_callback/exact.py``) at fixed parameters (lr = 0).
RESULTS.md, "Plain loops against exact values".

    python benchmarks/plain_loops.py --seeds 3              # every setup
    python benchmarks/plain_loops.py --seeds 1 --only amp   # the setups whose name holds "amp"
    python benchmarks/plain_loops.py --identity             # training loops, bit for bit with and without the meter

Each row: the setup, the exact value, the run average's estimate with its 95% interval per seed, how many
intervals held the exact value, and what the meter said (``failure``, or the first warning). A row whose meter
stopped or withheld the number reads "refused": that is the expected outcome for the misuse rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import types
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402

STEPS = 300
BATCH = 32


# ---------------------------------------------------------------- data and models
def dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A scikit-learn bundled data set as float32 inputs (standardised; digits scaled to [0, 1]) and int labels."""
    from sklearn import datasets
    data = {"digits": datasets.load_digits, "breast_cancer": datasets.load_breast_cancer,
            "wine": datasets.load_wine}[name]()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = x / 16 if name == "digits" else (x - x.mean(0)) / x.std(0)
    return x, torch.tensor(data.target)


class DigitRows(nn.Module):
    """A tiny transformer on the digits' 8 rows of 8 pixels: tokens, one encoder layer, mean pool, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(x.view(-1, 8, 8))).mean(1))


def make_model(name: str, features: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, classes))
    if name == "cnn":
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.ReLU(),
                             nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                             nn.Linear(8 * 4 * 4, classes))
    if name == "transformer":
        return DigitRows()
    raise ValueError(name)


# ---------------------------------------------------------------- the loops (as a newcomer writes them)
def draws(x: torch.Tensor, g: torch.Generator, size: int = BATCH) -> torch.Tensor:
    return torch.randint(0, len(x), (size,), generator=g)


def readme_loop(model, x, y, g, steps=STEPS, **meter_args):
    """The README's plain loop, per_example, batches drawn with replacement."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientNoiseScaleMeter(model, **meter_args) as meter:
        meter.check_batch(lambda b: F.cross_entropy(model(b[0]), b[1]), (x[:BATCH], y[:BATCH]))
        for _ in range(steps):
            i = draws(x, g)
            F.cross_entropy(model(x[i]), y[i]).backward()
            meter.step()
            opt.step()
            opt.zero_grad()
    return meter


def bf16_autocast(model, x, y, g, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientNoiseScaleMeter(model) as meter:
        for _ in range(steps):
            i = draws(x, g)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x[i]), y[i])
            loss.backward()
            meter.step()
            opt.step()
            opt.zero_grad()
    return meter


def fp16_scaler(unscale: bool, give: str, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
    """fp16 autocast with a real GradScaler. ``give``: which scale reaches ``meter.step(loss_scale=)``: "before"
    (get_scale() before update, the backward's), "none", or "after" (read after scaler.update(), with the meter's
    step moved after the optimizer's)."""
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(steps):
                i = draws(x, g)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(model(x[i]), y[i])
                scaler.scale(loss).backward()
                if unscale:
                    scaler.unscale_(opt)
                if give == "after":
                    scaler.step(opt)
                    scaler.update()
                    meter.step(loss_scale=scaler.get_scale())
                else:
                    meter.step(loss_scale=scaler.get_scale() if give == "before" else None)
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
        return meter
    return loop


def accumulate(k: int, method: str, sizes: tuple = (), give_sizes: bool = True, divide: bool = True,
               reduction: str = "mean", tell: bool = True, check: bool = False):
    """Gradient accumulation over ``k`` micro-batches, each loss divided by k (``divide``). ``sizes``: the
    micro-batches' sizes (default BATCH // k each), an uneven last one included. ``reduction``: of the loss;
    ``tell``: whether the meter is told it (``loss_reduction=``); ``check``: ``meter.check_batch`` on a first
    micro-batch before the first step (it finds the reduction)."""
    sizes = sizes or (BATCH // k,) * k

    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        told = reduction if tell else "mean"
        with GradientNoiseScaleMeter(model, method=method, loss_reduction=told) as meter:
            if check:
                i = draws(x, g, sizes[0])
                meter.check_batch(lambda b: F.cross_entropy(model(b[0]), b[1], reduction=reduction), (x[i], y[i]))
            for _ in range(steps):
                for size in sizes:
                    i = draws(x, g, size)
                    (F.cross_entropy(model(x[i]), y[i], reduction=reduction) / (k if divide else 1)).backward()
                meter.step(micro_batch_size=list(sizes) if give_sizes else None)
                opt.step()
                opt.zero_grad()
        return meter
    return loop


def split_batch(k: int, method: str):
    """One batch of BATCH split into k chunks by torch.split (the last one smaller where k does not divide it), each
    chunk's mean loss weighted by its share of the batch: the step's gradient is the batch's mean."""
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with GradientNoiseScaleMeter(model, method=method) as meter:
            for _ in range(steps):
                i = draws(x, g)
                chunks = i.split(-(-BATCH // k))
                for c in chunks:
                    (F.cross_entropy(model(x[c]), y[c]) * len(c) / BATCH).backward()
                meter.step(micro_batch_size=[len(c) for c in chunks], loss_divisor=None)
                opt.step()
                opt.zero_grad()
        return meter
    return loop


def fp16_recipe(k: int = 1, method: str = "per_example", clip: bool = True, clip_after: bool = False):
    """PyTorch's AMP recipe: scale, backward (k micro-batches, each loss / k), unscale_, clip, the meter's step just
    before scaler.step with the scale the backward passes ran with."""
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu")
        with GradientNoiseScaleMeter(model, method=method) as meter:
            for _ in range(steps):
                for _ in range(k):
                    i = draws(x, g, BATCH // k)
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = F.cross_entropy(model(x[i]), y[i]) / k
                    scaler.scale(loss).backward()
                scaler.unscale_(opt)
                if clip and not clip_after:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                meter.step(micro_batch_size=BATCH // k, loss_scale=scaler.get_scale())
                if clip_after:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        return meter
    return loop


def zero_grad_first(model, x, y, g, steps=STEPS):
    """zero_grad at the top of the loop (the other common order)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientNoiseScaleMeter(model) as meter:
        for _ in range(steps):
            opt.zero_grad()
            i = draws(x, g)
            F.cross_entropy(model(x[i]), y[i]).backward()
            meter.step()
            opt.step()
    return meter


def step_every_micro_batch(model, x, y, g, steps=STEPS):
    """Misuse: meter.step() after each of 4 accumulated micro-batches."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientNoiseScaleMeter(model) as meter:
        for _ in range(steps):
            for _ in range(4):
                i = draws(x, g, BATCH // 4)
                (F.cross_entropy(model(x[i]), y[i]) / 4).backward()
                meter.step()
            opt.step()
            opt.zero_grad()
    return meter


def clipping(before_meter: bool, max_norm: float = 0.5):
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(steps):
                i = draws(x, g)
                F.cross_entropy(model(x[i]), y[i]).backward()
                if before_meter:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                    meter.step()
                else:
                    meter.step()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()
                opt.zero_grad()
        return meter
    return loop


def scheduled(model, x, y, g, steps=STEPS):
    """An LR scheduler stepped every step (the LR stays 0: the parameters stay fixed)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    with GradientNoiseScaleMeter(model) as meter:
        for _ in range(steps):
            i = draws(x, g)
            F.cross_entropy(model(x[i]), y[i]).backward()
            meter.step()
            opt.step()
            sched.step()
            opt.zero_grad()
    return meter


def zeroing(how: str):
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(steps):
                i = draws(x, g)
                F.cross_entropy(model(x[i]), y[i]).backward()
                meter.step()
                opt.step()
                if how == "set_to_none=False":
                    opt.zero_grad(set_to_none=False)
                else:
                    model.zero_grad()
        return meter
    return loop


def epochs(drop_last: bool, population: bool):
    """DataLoader(shuffle=True) over the whole data set, epochs until STEPS steps."""
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=drop_last, generator=g)
        done = 0
        with GradientNoiseScaleMeter(model, population=loader if population else None) as meter:
            while done < steps:
                for xb, yb in loader:
                    F.cross_entropy(model(xb), yb).backward()
                    meter.step()
                    opt.step()
                    opt.zero_grad()
                    done += 1
                    if done == steps:
                        break
        return meter
    return loop


class HFStyle(nn.Module):
    """A model that takes a dict's keys and returns an object with ``.loss`` (Hugging Face's convention)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixel_values, labels=None):
        logits = self.net(pixel_values)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return types.SimpleNamespace(loss=loss, logits=logits)


def dict_batches(model, x, y, g, steps=STEPS):
    wrapped = HFStyle(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.0)
    with GradientNoiseScaleMeter(wrapped) as meter:
        i = draws(x, g)
        meter.check_batch(lambda b: wrapped(**b).loss, {"pixel_values": x[i], "labels": y[i]})
        for _ in range(steps):
            i = draws(x, g)
            batch = {"pixel_values": x[i], "labels": y[i]}
            wrapped(**batch).loss.backward()
            meter.step()
            opt.step()
            opt.zero_grad()
    return meter


def summed_loss(tell: bool):
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with GradientNoiseScaleMeter(model, loss_reduction="sum" if tell else "mean") as meter:
            for _ in range(steps):
                i = draws(x, g)
                F.cross_entropy(model(x[i]), y[i], reduction="sum").backward()
                meter.step()
                opt.step()
                opt.zero_grad()
        return meter
    return loop


def misuse(kind: str):
    """What a newcomer gets wrong: the meter's step at the wrong place, twice a step, or told a wrong size."""
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(steps):
                i = draws(x, g)
                loss = F.cross_entropy(model(x[i]), y[i])
                if kind == "step before backward":
                    meter.step()
                loss.backward()
                if kind == "step twice":
                    meter.step()
                    meter.step()
                elif kind == "wrong batch_size":
                    meter.step(micro_batch_size=2 * BATCH)
                elif kind == "step after zero_grad":
                    opt.step()
                    opt.zero_grad()
                    meter.step()
                    continue
                elif kind != "step before backward":
                    meter.step()
                opt.step()
                opt.zero_grad()
        return meter
    return loop


def micro_batch_size_wrong(given: int):
    """Misuse: 4 passes of 8 with method="micro_batch", told another size per pass."""
    def loop(model, x, y, g, steps=STEPS):
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with GradientNoiseScaleMeter(model, method="micro_batch") as meter:
            for _ in range(steps):
                for _ in range(4):
                    i = draws(x, g, 8)
                    (F.cross_entropy(model(x[i]), y[i]) / 4).backward()
                meter.step(micro_batch_size=given)
                opt.step()
                opt.zero_grad()
        return meter
    return loop


def check_batch_wrong_size(model, x, y, g, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with GradientNoiseScaleMeter(model) as meter:
        meter.check_batch(lambda b: F.cross_entropy(model(b[0]), b[1]), (x[:BATCH], y[:BATCH]), batch_size=2 * BATCH)
        for _ in range(steps):
            i = draws(x, g)
            F.cross_entropy(model(x[i]), y[i]).backward()
            meter.step()
            opt.step()
            opt.zero_grad()
    return meter


def _ddp_worker(rank: int, world: int, port: int, variant: str, seed: int, out: str) -> None:
    """One gloo rank of :func:`ddp`: the README's loop on a DistributedDataParallel model, batches of BATCH drawn
    per rank; rank 0 saves the run estimate."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gns_callback.meter import all_reduce_sum

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = dataset("digits")
    model = DistributedDataParallel(make_model("mlp", 64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(1000 * seed + rank)
    warnings.simplefilter("ignore")
    with GradientNoiseScaleMeter(model.module if variant == "module" else model,
                                 **({} if variant == "no reduce" else {"reduce": all_reduce_sum})) as meter:
        for _ in range(STEPS):
            i = draws(x, g)
            F.cross_entropy(model(x[i]), y[i]).backward()
            meter.step()
            opt.step()
            opt.zero_grad()
    e = meter.run_estimate
    if rank == 0:
        torch.save({k: getattr(e, k) for k in ("measured", "b_simple", "ci_low", "ci_high", "failure")}, out)
    dist.destroy_process_group()


def ddp(variant: str):
    """Two gloo processes (torch.multiprocessing.spawn), a DDP-wrapped model; ``variant``: "reduce" (the meter on the
    DDP model with reduce=gns_callback.meter.all_reduce_sum, as the docstring says), "module" (on its .module), or
    "no reduce" (the misuse). The data and model of the row are the workers' own (digits, MLP)."""
    def loop(model, x, y, g, steps=STEPS):
        import socket
        import tempfile

        import torch.multiprocessing as mp
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        seed = int(g.initial_seed())
        with tempfile.TemporaryDirectory() as folder:
            out = os.path.join(folder, "estimate.pt")
            mp.spawn(_ddp_worker, args=(2, port, variant, seed, out), nprocs=2)
            return types.SimpleNamespace(run_estimate=types.SimpleNamespace(**torch.load(out)))
    return loop


#: name -> (data set, model, loop). Loops run STEPS optimizer steps at lr 0.
SETUPS: dict[str, tuple[str, str, Callable]] = {
    "readme loop (reference)": ("digits", "mlp", readme_loop),
    "readme loop, cnn+groupnorm": ("digits", "cnn", readme_loop),
    "readme loop, transformer rows": ("digits", "transformer", readme_loop),
    "readme loop, breast cancer": ("breast_cancer", "mlp", readme_loop),
    "readme loop, wine": ("wine", "mlp", readme_loop),
    "amp bf16 autocast": ("digits", "mlp", bf16_autocast),
    "amp bf16 autocast, cnn": ("digits", "cnn", bf16_autocast),
    "amp fp16 scaler, unscale_ + scale": ("digits", "mlp", fp16_scaler(True, "before")),
    "amp fp16 scaler, scaled, no scale": ("digits", "mlp", fp16_scaler(False, "none")),
    "amp fp16 scaler, unscale_, no scale": ("digits", "mlp", fp16_scaler(True, "none")),
    "amp fp16 scaler, scaled + scale (misuse)": ("digits", "mlp", fp16_scaler(False, "before")),
    "amp fp16 scaler, scale read after update": ("digits", "mlp", fp16_scaler(True, "after", growth_interval=1)),
    "amp fp16 scaler, init_scale 2^40 (skips)": ("digits", "mlp", fp16_scaler(True, "before", init_scale=2.0 ** 40)),
    "amp fp16 scaler, transformer": ("digits", "transformer", fp16_scaler(True, "before")),
    "amp fp16 recipe: unscale_, clip, step": ("digits", "mlp", fp16_recipe()),
    "amp fp16 recipe, cnn": ("digits", "cnn", fp16_recipe()),
    "amp fp16 recipe, accumulate 4, micro_batch": ("digits", "mlp", fp16_recipe(4, "micro_batch")),
    "amp fp16 recipe, accumulate 4, per_example": ("digits", "mlp", fp16_recipe(4, "per_example")),
    "amp fp16 accumulate 4, micro_batch, no clip": ("digits", "mlp", fp16_recipe(4, "micro_batch", clip=False)),
    "amp fp16 accumulate 4, clip after meter.step": ("digits", "mlp", fp16_recipe(4, "micro_batch", clip_after=True)),
    "amp bf16 autocast, transformer": ("digits", "transformer", bf16_autocast),
    "accumulate 4, per_example": ("digits", "mlp", accumulate(4, "per_example")),
    "accumulate 4, per_example, no sizes": ("digits", "mlp", accumulate(4, "per_example", give_sizes=False)),
    "accumulate 4, micro_batch": ("digits", "mlp", accumulate(4, "micro_batch")),
    "accumulate 8+8+8+6 loss/4, per_example": ("digits", "mlp", accumulate(4, "per_example", (8, 8, 8, 6))),
    "accumulate 8+8+8+6 loss/4, micro_batch": ("digits", "mlp", accumulate(4, "micro_batch", (8, 8, 8, 6))),
    "accumulate 4, loss not divided, per_example": ("digits", "mlp", accumulate(4, "per_example", divide=False)),
    "accumulate 4, loss not divided, micro_batch": ("digits", "mlp", accumulate(4, "micro_batch", divide=False)),
    "accumulate 4, reduction=sum told, micro_batch": ("digits", "mlp", accumulate(4, "micro_batch", reduction="sum")),
    "accumulate 4, reduction=sum not told, micro_batch": ("digits", "mlp",
                                                          accumulate(4, "micro_batch", reduction="sum", tell=False)),
    "accumulate 8+8+8+6, loss not divided, micro_batch": ("digits", "mlp",
                                                          accumulate(4, "micro_batch", (8, 8, 8, 6), divide=False)),
    "accumulate 8+8+8+6, loss not divided, per_example": ("digits", "mlp",
                                                          accumulate(4, "per_example", (8, 8, 8, 6), divide=False)),
    "accumulate 8+8+8+6, sum not told, micro_batch": ("digits", "mlp", accumulate(
        4, "micro_batch", (8, 8, 8, 6), reduction="sum", tell=False)),
    "accumulate 8+8+8+6, sum told, micro_batch": ("digits", "mlp", accumulate(
        4, "micro_batch", (8, 8, 8, 6), reduction="sum")),
    "split 32 as 11+11+10, micro_batch": ("digits", "mlp", split_batch(3, "micro_batch")),
    "accumulate 4, micro_batch, cnn": ("digits", "cnn", accumulate(4, "micro_batch")),
    "clip_grad_norm_ after meter.step": ("digits", "mlp", clipping(False)),
    "clip_grad_norm_ before meter.step": ("digits", "mlp", clipping(True)),
    "zero_grad at the loop's top": ("digits", "mlp", zero_grad_first),
    "lr scheduler": ("digits", "mlp", scheduled),
    "zero_grad(set_to_none=False)": ("digits", "mlp", zeroing("set_to_none=False")),
    "model.zero_grad()": ("digits", "mlp", zeroing("model")),
    "epochs, drop_last=False, population": ("wine", "mlp", epochs(False, True)),
    "epochs, drop_last=True, population": ("wine", "mlp", epochs(True, True)),
    "epochs, drop_last=False, no population": ("wine", "mlp", epochs(False, False)),
    "epochs digits, drop_last=False, population": ("digits", "mlp", epochs(False, True)),
    "ddp gloo x2, reduce=all_reduce_sum": ("digits", "mlp", ddp("reduce")),
    "ddp gloo x2, meter on .module, reduce": ("digits", "mlp", ddp("module")),
    "ddp gloo x2, no reduce (misuse)": ("digits", "mlp", ddp("no reduce")),
    "dict batches, .loss model": ("digits", "mlp", dict_batches),
    "reduction=sum, loss_reduction='sum'": ("digits", "mlp", summed_loss(True)),
    "reduction=sum, not told": ("digits", "mlp", summed_loss(False)),
    "misuse: step after zero_grad": ("digits", "mlp", misuse("step after zero_grad")),
    "misuse: step before backward": ("digits", "mlp", misuse("step before backward")),
    "misuse: step twice a step": ("digits", "mlp", misuse("step twice")),
    "misuse: step every micro-batch": ("digits", "mlp", step_every_micro_batch),
    "accumulate 16+16+16+2, sum not told, micro_batch": ("digits", "mlp", accumulate(
        4, "micro_batch", (16, 16, 16, 2), reduction="sum", tell=False)),
    "accumulate 16+16+16+2, sum not told, per_example": ("digits", "mlp", accumulate(
        4, "per_example", (16, 16, 16, 2), reduction="sum", tell=False)),
    "accumulate 16+16+16+2, sum told, per_example": ("digits", "mlp", accumulate(
        4, "per_example", (16, 16, 16, 2), reduction="sum")),
    "accumulate 16+16+16+2, sum not told, check_batch, per_example": ("digits", "mlp", accumulate(
        4, "per_example", (16, 16, 16, 2), reduction="sum", tell=False, check=True)),
    "accumulate 16+16+16+2, sum not told, check_batch, micro_batch": ("digits", "mlp", accumulate(
        4, "micro_batch", (16, 16, 16, 2), reduction="sum", tell=False, check=True)),
    "accumulate 16+16+16+2 loss/4, micro_batch": ("digits", "mlp", accumulate(4, "micro_batch", (16, 16, 16, 2))),
    "accumulate 16+16+16+2, not divided, micro_batch": ("digits", "mlp", accumulate(
        4, "micro_batch", (16, 16, 16, 2), divide=False)),
    "misuse: micro_batch_size=64 (32 given)": ("digits", "mlp", misuse("wrong batch_size")),
    "misuse: micro_batch, micro_batch_size=32 (4 x 8)": ("digits", "mlp", micro_batch_size_wrong(32)),
    "misuse: micro_batch, micro_batch_size=4 (4 x 8)": ("digits", "mlp", micro_batch_size_wrong(4)),
    "misuse: check_batch(batch_size=64)": ("digits", "mlp", check_batch_wrong_size),
}

_EXACT: dict[tuple[str, str], float] = {}


def exact(data: str, model_name: str) -> float:
    if (data, model_name) not in _EXACT:
        x, y = dataset(data)
        model = make_model(model_name, x.shape[1], int(y.max()) + 1)
        _EXACT[data, model_name] = exact_b_simple(model, F.cross_entropy, x, y)[0]
    return _EXACT[data, model_name]


def measure(name: str, seed: int) -> tuple[float, object, list[str], str]:
    """One run of a setup: (exact, run estimate, warnings, error raised or '')."""
    data, model_name, loop = SETUPS[name]
    x, y = dataset(data)
    model = make_model(model_name, x.shape[1], int(y.max()) + 1)
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            meter = loop(model, x, y, g)
        except Exception as error:  # noqa: BLE001 - a crash is a row of the table
            return exact(data, model_name), None, [], f"{type(error).__name__}: {error}"
    said = [str(w.message) for w in caught if "gns_callback" in str(w.message) or "meter" in str(w.message)]
    return exact(data, model_name), meter.run_estimate, said, ""


def number(value: float) -> str:
    """One decimal from 10 up, two below (the breast-cancer and wine values are about 4)."""
    return f"{value:.1f}" if abs(value) >= 10 or value != value or value in (float("inf"),) else f"{value:.2f}"


def seed_cells(measure: Callable, name: str, seeds: int, verbose: bool) -> tuple[float, str, str]:
    """One table row's middle: ``(exact, "cell | cell | ... | held/measured", what was said first)`` over ``seeds``
    runs of ``measure(name, seed) -> (exact, estimate, warnings, error)``."""
    cells, held, said, value = [], 0, "", float("nan")
    for seed in range(seeds):
        value, estimate, warned, error = measure(name, seed)
        cells.append(cell(estimate, error))
        if estimate is not None and estimate.measured:
            held += estimate.ci_low <= value <= estimate.ci_high
        note = error or (estimate.failure if estimate is not None and estimate.failure else "")
        note = note or (warned[0] if warned else "")
        if note and not said:
            said = note if verbose else note[:110] + ("…" if len(note) > 110 else "")
    measured = sum(c not in ("refused", "crash") for c in cells)
    return value, " | ".join(cells) + f" | {held}/{measured}", said


def cell(estimate, error: str) -> str:
    if error:
        return "crash"
    if not estimate.measured:
        return "refused"
    return f"{number(estimate.b_simple)} [{number(estimate.ci_low)}, {number(estimate.ci_high)}]"


def trained(kind: str, loop: str, with_meter: bool, steps: int = 40) -> tuple:
    """A loop that trains (SGD lr 0.1, momentum 0.9, StepLR, DataLoader(shuffle=True) on torch's global generator,
    clipping), ``steps`` steps with or without the meter: its weights, momentum buffers, torch's, Python's and numpy's
    random states after it, and the labels in the order drawn. ``kind``: mlp, dropout (an MLP with Dropout(0.2)),
    cnn, transformer; ``loop``: plain (with check_batch, no population=: the meter finds the loader), accumulate
    (4 passes of 8, micro_batch), fp16 (GradScaler, unscale_, clipping)."""
    import contextlib
    import random

    import numpy as np
    torch.manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    x, y = dataset("digits")
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 10)) if kind == "dropout"
             else make_model(kind, 64, 10))
    torch.manual_seed(123)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 20, growth_interval=3) if loop == "fp16" else None
    meter = (GradientNoiseScaleMeter(model, method="micro_batch" if loop == "accumulate" else "per_example",
                                     population=None if loop == "plain" else loader) if with_meter else None)
    order, done = [], 0
    with warnings.catch_warnings(), (meter if meter is not None else contextlib.nullcontext()):
        warnings.simplefilter("ignore")
        if meter is not None and loop == "plain":
            meter.check_batch(lambda b: F.cross_entropy(model(b[0]), b[1]), (x[:BATCH], y[:BATCH]))
        while done < steps:
            for xb, yb in loader:
                order.append(yb)
                if loop == "accumulate":
                    for xc, yc in zip(xb.split(8), yb.split(8)):
                        (F.cross_entropy(model(xc), yc) / 4).backward()
                    if meter is not None:
                        meter.step(micro_batch_size=[len(c) for c in yb.split(8)])
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                elif loop == "fp16":
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = F.cross_entropy(model(xb), yb)
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                    if meter is not None:
                        meter.step(loss_scale=scaler.get_scale())
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                else:
                    F.cross_entropy(model(xb), yb).backward()
                    if meter is not None:
                        meter.step()
                    opt.step()
                sched.step()
                opt.zero_grad()
                done += 1
                if done == steps:
                    break
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    momentum = torch.cat([opt.state[p]["momentum_buffer"].flatten() for p in model.parameters()])
    return weights, momentum, torch.get_rng_state(), random.getstate(), np.random.get_state()[1], torch.cat(order)


def identity_table() -> None:
    """Whether each loop trains exactly as without the meter (:func:`trained`)."""
    import numpy as np
    print("| model | loop | weights | momentum | torch RNG | Python RNG | numpy RNG | data order |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, loop in (("mlp", "plain"), ("dropout", "plain"), ("cnn", "plain"), ("transformer", "plain"),
                       ("mlp", "accumulate"), ("mlp", "fp16"), ("dropout", "fp16")):
        a, b = trained(kind, loop, False), trained(kind, loop, True)
        same = [torch.equal(a[0], b[0]), torch.equal(a[1], b[1]), torch.equal(a[2], b[2]), a[3] == b[3],
                bool(np.array_equal(a[4], b[4])), torch.equal(a[5], b[5])]
        print(f"| {kind} | {loop} | " + " | ".join("identical" if s else "DIFFERENT" for s in same) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", default="", help="run only the setups whose name holds this text")
    parser.add_argument("--verbose", action="store_true", help="print each warning and failure in full")
    parser.add_argument("--identity", action="store_true",
                        help="instead: whether training loops run bit for bit as without the meter (40 steps, lr 0.1)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.identity:
        return identity_table()
    print("| setup | data, model | exact | " + " | ".join(f"seed {s}" for s in range(options.seeds))
          + " | held | what the meter said |")
    print("|---|---|---|" + "---|" * options.seeds + "---|---|")
    for name, (data, model_name, _) in SETUPS.items():
        if options.only not in name:
            continue
        value, cells, said = seed_cells(measure, name, options.seeds, options.verbose)
        print(f"| {name} | {data}, {model_name} | {number(value)} | {cells} | {said} |", flush=True)


if __name__ == "__main__":
    main()
