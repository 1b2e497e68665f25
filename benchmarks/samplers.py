"""How batches are drawn, against exact values: weighted samplers, bucketing batch samplers, iterable data sets,
short last batches under accumulation, and a DistributedSampler over 2 gloo processes.

Each setup is a real Lightning fit, the callback at its defaults, ``lr=0`` (fixed parameters), on one of
scikit-learn's small data sets. Two reference values:

* ``exact``: ``B_simple`` of the sampling distribution drawn with replacement, ``tr Σ/|G|²`` with
  ``G = Σ p_i g_i`` and ``tr Σ = Σ p_i |g_i − G|²`` (``p_i = 1/N``: :func:`gns_callback.exact.exact_b_simple`;
  the weighted sampler's ``p_i``: :func:`weighted_exact`);
* ``sampler``: what the training sees at its batch size ``B``, by Monte Carlo over the sampler's own batches at
  the same fixed parameters: ``B·tr Cov(Ḡ_B)/|E Ḡ_B|²``, where ``E`` and ``Cov`` are over the batches the sampler
  yields (:func:`sampler_value`). For batches of independent draws it equals ``exact``; for a shuffled epoch it is
  ``exact·(N − B)/(N − 1)`` (the package reports the population's ``exact``, corrected: ``gns_callback.sampling``).

Run: ``PYTHONPATH=$PWD python benchmarks/samplers.py [--seeds 3] [--ddp]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer, load_digits, load_wine
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Sampler, TensorDataset, WeightedRandomSampler

from gns_callback import GradientNoiseScaleCallback
from gns_callback.exact import exact_noise_scale, per_example_gradients
from tests.helpers import Classifier, quiet_trainer

LOADERS = {"wine": load_wine, "breast_cancer": load_breast_cancer, "digits": load_digits}


def data(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    bunch = LOADERS[name]()
    x = torch.tensor(bunch.data, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-6), torch.tensor(bunch.target)


def net(features: int, classes: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(features, 32), nn.Tanh(), nn.Linear(32, classes))
    with torch.no_grad():
        model[2].weight.mul_(3.0)
    return model


PRETRAIN = {"steps": 0}  # --pretrain: full-batch SGD steps before the fit, for a larger B_simple/N


def net_for(name: str) -> nn.Module:
    """:func:`net` for data set ``name``, after ``PRETRAIN["steps"]`` full-batch SGD steps (lr 0.05) on it: nearer a
    minimum, ``|G|²`` falls and ``B_simple`` grows (wine: 4.0 at 0 steps, 41 at 50), so that effects of order
    ``B_simple/N`` show."""
    x, y = data(name)
    model = net(x.shape[1], int(y.max()) + 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(PRETRAIN["steps"]):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    model.zero_grad(set_to_none=True)
    return model


def weighted_exact(rows: torch.Tensor, p: torch.Tensor) -> float:
    """``tr Σ/|G|²`` of draws with probabilities ``p`` (with replacement): ``G = Σ p_i g_i``,
    ``tr Σ = Σ p_i |g_i − G|²``."""
    p = p.double() / p.double().sum()
    mean = (p[:, None] * rows).sum(0)
    trace = (p * (rows - mean).pow(2).sum(1)).sum()
    return (trace / mean.pow(2).sum()).item()


def sampler_value(rows: torch.Tensor, batches: Callable[[], Iterator[list[int]]], epochs: int, size: int) -> float:
    """``B·tr Cov(Ḡ_B)/|E Ḡ_B|²`` over the full batches of ``size`` that ``batches()`` yields, ``epochs``
    times."""
    means = [rows[index].mean(0) for _ in range(epochs) for index in batches() if len(index) == size]
    means = torch.stack(means)
    centre = means.mean(0)
    return (size * (means - centre).pow(2).sum(1).mean() / centre.pow(2).sum()).item()


# ----------------------------------------------------------------------------------------------- samplers
def class_weights(y: torch.Tensor) -> torch.Tensor:
    counts = torch.bincount(y).double()
    return 1.0 / counts[y]


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of one bucket each (``keys``: a class, or a feature's bin, as length bucketing does): each epoch,
    each bucket's examples shuffled and cut into batches, the batches shuffled. Every example once per epoch."""

    def __init__(self, keys: torch.Tensor, batch_size: int, seed: int) -> None:
        self.keys, self.batch_size, self.rng = keys, batch_size, random.Random(seed)

    def _batches(self) -> list[list[int]]:
        out = []
        for key in sorted(set(self.keys.tolist())):
            members = [i for i, k in enumerate(self.keys.tolist()) if k == key]
            self.rng.shuffle(members)
            out += [members[s:s + self.batch_size] for s in range(0, len(members), self.batch_size)]
        self.rng.shuffle(out)
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return sum(-(-int((self.keys == k).sum()) // self.batch_size) for k in set(self.keys.tolist()))


def feature_bins(x: torch.Tensor, bins: int = 4) -> torch.Tensor:
    """The bin of feature 0 (quantiles): a stand-in for sequence length."""
    edges = torch.quantile(x[:, 0], torch.linspace(0, 1, bins + 1)[1:-1])
    return torch.bucketize(x[:, 0], edges)


class ShuffledStream(IterableDataset):
    """The data set streamed in a new random order each epoch (``shuffle in __iter__``)."""

    def __init__(self, x, y, seed: int) -> None:
        self.x, self.y, self.generator = x, y, torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.x)

    def order(self) -> list[int]:
        return torch.randperm(len(self.x), generator=self.generator).tolist()

    def __iter__(self):
        return ((self.x[i], self.y[i]) for i in self.order())


class UnsizedStream(ShuffledStream):
    """:class:`ShuffledStream` with no length (``len()`` raises ``TypeError``)."""

    __len__ = None  # type: ignore[assignment]


class BufferedStream(ShuffledStream):
    """Data stored in class order, read through a shuffle buffer of ``buffer`` examples (as
    ``torchdata``/webdataset do): a local shuffle, not a random order."""

    def __init__(self, x, y, seed: int, buffer: int = 16) -> None:
        order = torch.argsort(y, stable=True)
        super().__init__(x[order], y[order], seed)
        self.buffer = buffer
        self.rng = random.Random(seed)

    def order(self) -> list[int]:
        pool, out = [], []
        for i in range(len(self.x)):
            pool.append(i)
            if len(pool) == self.buffer:
                out.append(pool.pop(self.rng.randrange(len(pool))))
        while pool:
            out.append(pool.pop(self.rng.randrange(len(pool))))
        return out


# ----------------------------------------------------------------------------------------------- one fit
def fit(name: str, loader: DataLoader, epochs: int, accumulate: int = 1,
        random_order: bool = False) -> tuple[GradientNoiseScaleCallback, list]:
    x, y = data(name)
    callback = GradientNoiseScaleCallback(verbose=False, report_path=str(Path(tempfile.mkdtemp()) / "r.json"),
                                          data_in_random_order=random_order)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            quiet_trainer(max_epochs=epochs, callbacks=[callback], accumulate_grad_batches=accumulate).fit(
                Classifier(net_for(name)), loader)
        except Exception as error:  # noqa: BLE001 - a refusal is a row too
            return callback, [f"REFUSED: {type(error).__name__}: {str(error)[:200]}"]
    said = [str(w.message)[:160] for w in caught if "GradientNoiseScale" in str(w.message)]
    return callback, said


def row(setup: str, name: str, seed: int, exact: float, truth: float, callback, said: list, reference: float) -> dict:
    refused = bool(said) and said[0].startswith("REFUSED")
    est = callback.run_estimate if callback.meter is not None and not refused else None
    if est is None or not getattr(est, "steps", 0):
        return {"setup": setup, "data": name, "seed": seed, "exact": exact, "sampler": truth, "estimate": None,
                "ci": None, "held": None, "said": said}
    held = est.ci_low <= reference <= est.ci_high
    return {"setup": setup, "data": name, "seed": seed, "exact": exact, "sampler": truth, "estimate": est.b_simple,
            "ci": [est.ci_low, est.ci_high], "held": held,
            "population": callback.meter.population, "said": said}


def setups(name: str, seed: int, only: str = "") -> list[dict]:
    """The rows of data set ``name`` at ``seed`` (those whose setup name contains ``only``)."""
    x, y = data(name)
    rows = per_example_gradients(net_for(name), F.cross_entropy, x, y)
    exact = exact_noise_scale(rows)[0]
    n, size = len(x), 16
    epochs = max(8, 12000 // n)
    out = []
    g = lambda: torch.Generator().manual_seed(seed)  # noqa: E731
    dataset = TensorDataset(x, y)
    w = class_weights(y)

    def run(setup: str, loader, truth: float, reference: float, exact_shown: float = exact, **kwargs) -> None:
        if only in setup:
            cb, said = fit(name, loader, epochs, **kwargs)
            out.append(row(setup, name, seed, exact_shown, truth, cb, said, reference))

    def batches_of(make_sampler) -> Callable[[], Iterator[list[int]]]:
        return lambda s=make_sampler(): iter(DataLoader(range(n), batch_size=size, sampler=s))

    # 0. the plain shuffled epoch, for comparison
    if only in "shuffle=True":
        run("shuffle=True", DataLoader(dataset, batch_size=size, shuffle=True, drop_last=True, generator=g()),
            float("nan"), exact)
    # 1. weighted: class-balancing weights, with and without replacement (num_samples = N: without, each epoch a
    # permutation, biased in order)
    if only in "weighted, replacement=True":
        wexact = weighted_exact(rows, w)
        truth = sampler_value(rows, batches_of(lambda: WeightedRandomSampler(w, n, True, generator=g())), 300, size)
        run("weighted, replacement=True", DataLoader(dataset, batch_size=size, sampler=WeightedRandomSampler(
            w, n, replacement=True, generator=g())), truth, wexact, exact_shown=wexact)
    if only in "weighted, replacement=False":
        truth = sampler_value(rows, batches_of(lambda: WeightedRandomSampler(w, n, False, generator=g())), 300, size)
        run("weighted, replacement=False", DataLoader(dataset, batch_size=size, sampler=WeightedRandomSampler(
            w, n, replacement=False, generator=g())), truth, exact)
    if only in "weighted, replacement=False, drop_last=True":
        truth = sampler_value(rows, batches_of(lambda: WeightedRandomSampler(w, n, False, generator=g())), 300, size)
        run("weighted, replacement=False, drop_last=True", DataLoader(dataset, batch_size=size, drop_last=True,
            sampler=WeightedRandomSampler(w, n, replacement=False, generator=g())), truth, exact)
    # 2. bucketing batch samplers
    for label, keys in (("bucketed by class", y), ("bucketed by feature-0 bin", feature_bins(x))):
        if only in label:
            truth = sampler_value(rows, lambda b=BucketBatchSampler(keys, size, seed): iter(b), 300, size)
            run(label, DataLoader(dataset, batch_sampler=BucketBatchSampler(keys, size, seed)), truth, truth)
    # 3. iterable data sets
    truth = sampler_value(rows, lambda s=ShuffledStream(x, y, seed): iter(DataLoader(s.order(), batch_size=size)),
                          300, size)
    run("IterableDataset, shuffled in __iter__", DataLoader(ShuffledStream(x, y, seed), batch_size=size), truth,
        exact)
    run("IterableDataset, shuffled in __iter__, data_in_random_order=True",
        DataLoader(ShuffledStream(x, y, seed), batch_size=size), truth, exact, random_order=True)
    run("IterableDataset, shuffled, no __len__, data_in_random_order=True",
        DataLoader(UnsizedStream(x, y, seed), batch_size=size), truth, exact, random_order=True)
    if only in "IterableDataset, shuffle buffer 16 over class order":
        order = torch.argsort(y, stable=True)
        truth = sampler_value(rows[order], lambda s=BufferedStream(x, y, seed): iter(
            DataLoader(s.order(), batch_size=size)), 300, size)
        run("IterableDataset, shuffle buffer 16 over class order", DataLoader(BufferedStream(x, y, seed),
                                                                              batch_size=size), truth, exact)
    # 4. shuffle=True, drop_last=False, a short last batch, accumulate 3 (a short last window)
    b4 = 24 if name == "wine" else size
    run(f"shuffle, drop_last=False (B={b4}, N%B={n % b4}), accumulate 3",
        DataLoader(dataset, batch_size=b4, shuffle=True, drop_last=False, generator=g()), float("nan"), exact,
        accumulate=3)
    return out


# ----------------------------------------------------------------------------------------------- DDP
class DistributedWine(Classifier):
    def setup(self, stage: str) -> None:
        torch.set_num_threads(1)

    def train_dataloader(self):
        x, y = data("wine")
        return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, drop_last=True)


def ddp_row(seed: int, epochs: int = 40) -> dict:
    """``DistributedSampler`` (Lightning puts it in) over 2 gloo processes on wine: each epoch one shuffled order,
    sharded: 89 examples a rank, 5 batches of 16 a rank, 32 a step."""
    import pytorch_lightning as pl

    torch.multiprocessing.set_sharing_strategy("file_system")
    x, y = data("wine")
    rows = per_example_gradients(net_for("wine"), F.cross_entropy, x, y)
    exact = exact_noise_scale(rows)[0]
    report = Path(tempfile.mkdtemp()) / "r.json"
    pl.seed_everything(seed, verbose=False)
    callback = GradientNoiseScaleCallback(verbose=False, report_path=str(report))
    quiet_trainer(strategy="ddp_spawn", devices=2, max_epochs=epochs, callbacks=[callback]).fit(
        DistributedWine(net_for("wine")))
    saved = json.loads(report.read_text())
    run = saved["run_estimate"]
    return {"setup": "DistributedSampler, 2 gloo ranks x 16", "data": "wine", "seed": seed, "exact": exact,
            "sampler": float("nan"), "estimate": run["b_simple"], "ci": [run["ci_low"], run["ci_high"]],
            "held": run["ci_low"] <= exact <= run["ci_high"],
            "population": saved["run"].get("drawn_without_replacement_from"), "said": []}


def show(r: dict) -> str:
    ci = "" if r["ci"] is None else f"[{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]"
    est = "—" if r["estimate"] is None else f"{r['estimate']:.2f}"
    said = "; ".join(r["said"]) if r["said"] else ""
    return (f"| {r['setup']} | {r['data']} | {r['seed']} | {r['exact']:.2f} | {r['sampler']:.2f} | {est} {ci} | "
            f"{r['held']} | {r.get('population')} | {said} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--data", nargs="*", default=["wine", "breast_cancer", "digits"])
    parser.add_argument("--ddp", action="store_true", help="only the DistributedSampler row(s)")
    parser.add_argument("--pretrain", type=int, default=0, help="full-batch SGD steps before (larger B_simple)")
    parser.add_argument("--only", default="", help="only the setups whose name contains this")
    args = parser.parse_args()
    PRETRAIN["steps"] = args.pretrain
    torch.set_num_threads(1)
    print("| setup | data | seed | exact | sampler | estimate [CI] | held | population | said |")
    print("|---|---|---|---|---|---|---|---|---|")
    if args.ddp:
        for seed in range(args.seeds):
            print(show(ddp_row(seed)), flush=True)  # the module, and its net, pickled to each process
        return
    for name in args.data:
        for seed in range(args.seeds):
            for r in setups(name, seed, args.only):
                print(show(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
