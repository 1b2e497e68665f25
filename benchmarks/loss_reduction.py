"""The Lightning callback with losses that are not a plain per-batch mean, and batches of uneven size, against the
exact ``B_simple`` (brute force over the whole data set, ``gns_callback/exact.py``) at fixed parameters (lr = 0).
RESULTS.md, "Loss reduction and uneven batches in Lightning against exact values".

    python benchmarks/loss_reduction.py --seeds 3              # every setup
    python benchmarks/loss_reduction.py --seeds 1 --only sum   # the setups whose name holds "sum"

Each setup trains a ``LightningModule`` for a few epochs of a ``DataLoader(shuffle=True, drop_last=False)`` whose
last batch is short (digits: 1797 = 56·32 + 5; breast cancer: 569 = 10·56 + 9), the callback at its defaults
unless the row says otherwise. "batches 32, 32, 5" rows use a batch sampler that draws every epoch without
replacement in batches of 32, 32, 5, 32, 32, 5, … (a bucketing sampler's uneven sizes, at every step). Each row:
the exact value, the run estimate with its 95% interval per seed, how many intervals held it, and what the callback
said (its ``failure``, or the first of its warnings).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytorch_lightning as pl  # noqa: E402

from benchmarks.plain_loops import dataset, make_model, number, seed_cells  # noqa: E402
from gns_callback import GradientNoiseScaleCallback  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402

BATCHES = {"digits": 32, "breast_cancer": 56}
EPOCHS = {"digits": 4, "breast_cancer": 12}


class RowTokens(nn.Module):
    """The digits' 8 rows as 8 tokens: each row embedded, a context (the tokens' mean) added, logits per token:
    ``(B, 8, 10)``, every token's target the image's label."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x.view(-1, 8, 8)))
        return self.head(torch.tanh(self.mix(h + h.mean(1, keepdim=True))))


def token_targets(out: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return out.reshape(-1, out.shape[-1]), y.repeat_interleave(out.shape[1])


def tokens_summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token losses summed over each example's tokens, averaged over the examples."""
    logits, targets = token_targets(out, y)
    return F.cross_entropy(logits, targets, reduction="none").view(out.shape[0], -1).sum(1).mean()


def tokens_mean(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Averaged over every token of the batch (as many tokens per example: a constant factor from the above)."""
    return F.cross_entropy(*token_targets(out, y))


#: The losses a ``training_step`` returns (``accumulate`` divides by Lightning's ``accumulate_grad_batches``).
LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "mean": lambda out, y, k: F.cross_entropy(out, y),
    "sum": lambda out, y, k: F.cross_entropy(out, y, reduction="sum"),
    "sum / 32": lambda out, y, k: F.cross_entropy(out, y, reduction="sum") / 32,
    "mean * 10": lambda out, y, k: F.cross_entropy(out, y) * 10,
    "sum / accumulate": lambda out, y, k: F.cross_entropy(out, y, reduction="sum") / k,
    "tokens summed, examples averaged": lambda out, y, k: tokens_summed(out, y),
    "mean over tokens": lambda out, y, k: tokens_mean(out, y),
}


class Module(pl.LightningModule):
    def __init__(self, net: nn.Module, loss: str, accumulate: int) -> None:
        super().__init__()
        self.net, self.loss, self.accumulate = net, loss, accumulate

    def training_step(self, batch, batch_idx):
        x, y = batch
        return LOSSES[self.loss](self.net(x), y, self.accumulate)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class CycledSizes(BatchSampler):
    """Every epoch a fresh permutation (``RandomSampler``), cut into batches of ``sizes[0], sizes[1], …`` in turn."""

    def __init__(self, sampler: RandomSampler, sizes: tuple[int, ...]) -> None:
        super().__init__(sampler, max(sizes), False)
        self.sizes = sizes

    def __iter__(self) -> Iterator[list[int]]:
        order, start, turn = list(self.sampler), 0, 0
        while start < len(order):
            size = self.sizes[turn % len(self.sizes)]
            yield order[start:start + size]
            start, turn = start + size, turn + 1

    def __len__(self) -> int:
        n, count, turn = len(self.sampler), 0, 0
        while n > 0:
            n, count, turn = n - self.sizes[turn % len(self.sizes)], count + 1, turn + 1
        return count


def model_for(data: str, model_name: str) -> nn.Module:
    x, y = dataset(data)
    return RowTokens() if model_name == "tokens" else make_model(model_name, x.shape[1], int(y.max()) + 1)


_EXACT: dict[tuple[str, str], float] = {}


def exact(data: str, model_name: str) -> float:
    """Per-example losses: cross-entropy, or for the token model the sum over its tokens (a constant factor from
    the mean over them: the same ``B_simple``)."""
    if (data, model_name) not in _EXACT:
        x, y = dataset(data)
        loss = (lambda out, t: tokens_summed(out, t)) if model_name == "tokens" else F.cross_entropy
        _EXACT[data, model_name] = exact_b_simple(model_for(data, model_name), loss, x, y)[0]
    return _EXACT[data, model_name]


#: name: (data, model, loss, accumulate_grad_batches, callback arguments, batch sizes cycled or None)
SETUPS: dict[str, tuple] = {}


def _add(name: str, data: str, model: str, loss: str, k: int, told: dict, sizes: tuple = ()) -> None:
    SETUPS[f"{name} ({data}, {model})"] = (data, model, loss, k, told, sizes)


for _data, _model in (("digits", "mlp"), ("digits", "cnn"), ("breast_cancer", "mlp")):
    for _k in (1, 3):
        _add(f"1. sum, accumulate {_k}, not told", _data, _model, "sum", _k, {})
        _add(f"1. sum, accumulate {_k}, loss_reduction='sum'", _data, _model, "sum", _k, {"loss_reduction": "sum"})
    _add("2. mean, accumulate 3", _data, _model, "mean", 3, {})
for _data, _model in (("digits", "mlp"), ("breast_cancer", "mlp")):
    _add("3. sum / 32, accumulate 3, not told", _data, _model, "sum / 32", 3, {})
    _add("3. sum / 32, accumulate 3, loss_reduction='sum'", _data, _model, "sum / 32", 3, {"loss_reduction": "sum"})
    _add("3. mean * 10, accumulate 3", _data, _model, "mean * 10", 3, {})
    _add("4. sum / accumulate, accumulate 3, not told", _data, _model, "sum / accumulate", 3, {})
    _add("4. sum / accumulate, accumulate 3, loss_reduction='sum'", _data, _model, "sum / accumulate", 3,
         {"loss_reduction": "sum"})
    for _loss, _told in (("sum", {}), ("sum", {"loss_reduction": "sum"}), ("mean", {})):
        _tell = ", loss_reduction='sum'" if _told else (", not told" if _loss == "sum" else "")
        _add(f"5. micro_batch, {_loss}, accumulate 3{_tell}", _data, _model, _loss, 3,
             {"method": "micro_batch", **_told})
for _loss in ("tokens summed, examples averaged", "mean over tokens"):
    _add(f"6. {_loss}, accumulate 3", "digits", "tokens", _loss, 3, {})
for _loss, _told in (("sum", {}), ("sum", {"loss_reduction": "sum"}), ("mean", {})):
    for _k in (1, 3):
        _tell = ", loss_reduction='sum'" if _told else (", not told" if _loss == "sum" else "")
        _add(f"7. batches 32, 32, 5, {_loss}, accumulate {_k}{_tell}", "digits", "mlp", _loss, _k, _told, (32, 32, 5))
    _add(f"7. batches 32, 32, 5, micro_batch, {_loss}, accumulate 3{_tell}", "digits", "mlp", _loss, 3,
         {"method": "micro_batch", **_told}, (32, 32, 5))

_add("8. mean, accumulate 3, loss_reduction='sum' (told wrong)", "breast_cancer", "mlp", "mean", 3,
     {"loss_reduction": "sum"})
_add("8. batches 32, 32, 5, mean, accumulate 3, loss_reduction='sum' (told wrong)", "digits", "mlp", "mean", 3,
     {"loss_reduction": "sum"}, (32, 32, 5))


def loader(data: str, sizes: tuple) -> DataLoader:
    x, y = dataset(data)
    if sizes:
        return DataLoader(TensorDataset(x, y), batch_sampler=CycledSizes(RandomSampler(range(len(x))), sizes))
    return DataLoader(TensorDataset(x, y), batch_size=BATCHES[data], shuffle=True, drop_last=False)


def measure(name: str, seed: int) -> tuple[float, object, list[str], str]:
    """One fit of a setup: (exact, run estimate, warnings, error raised or '')."""
    data, model_name, loss, k, told, sizes = SETUPS[name]
    module = Module(model_for(data, model_name), loss, k)  # seeds torch with 0: the shuffles' seed comes after
    pl.seed_everything(seed, verbose=False)
    # CycledSizes is a batch sampler of its own: the callback refuses it unless told its batches are random draws.
    callback = GradientNoiseScaleCallback(verbose=False, data_in_random_order=bool(sizes), **told)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=EPOCHS[data] * (2 if sizes else 1),
                         accumulate_grad_batches=k, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, loader(data, sizes))
        except Exception as error:  # noqa: BLE001 - a crash is a row of the table
            return exact(data, model_name), None, [], f"{type(error).__name__}: {error}"
    said = [str(w.message) for w in caught if "gns_callback" in str(w.message) or "noise" in str(w.message)]
    return exact(data, model_name), callback.run_estimate, said, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--only", default="", help="run only the setups whose name holds this text")
    parser.add_argument("--verbose", action="store_true", help="print each warning and failure in full")
    options = parser.parse_args()
    torch.set_num_threads(1)
    import logging
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    print("| setup | exact | " + " | ".join(f"seed {s}" for s in range(options.seeds)) + " | held | what it said |")
    print("|---|---|" + "---|" * options.seeds + "---|---|")
    for name in SETUPS:
        if options.only not in name:
            continue
        value, cells, said = seed_cells(measure, name, options.seeds, options.verbose)
        print(f"| {name} | {number(value)} | {cells} | {said} |", flush=True)


if __name__ == "__main__":
    main()
