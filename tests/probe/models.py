"""Small modules and callbacks shared by the probe tests."""

from __future__ import annotations

import json
from typing import Any, Optional, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset

from gns_callback.probe import probe_trainer
from tests.helpers import Classifier

OOM_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.1 GiB already allocated)"


class ThresholdClassifier(Classifier):
    """Raises a real-looking CUDA OOM in ``training_step`` for micro-batches above a threshold (per rank)."""

    def __init__(self, net, thresholds: Sequence[int], **kwargs: Any) -> None:
        super().__init__(net, **kwargs)
        self.thresholds = list(thresholds)
        self.sizes_seen: list[int] = []

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.sizes_seen.append(x.shape[0])
        if x.shape[0] > self.thresholds[self.global_rank % len(self.thresholds)]:
            raise RuntimeError(OOM_MESSAGE)
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss


def digits_loader(x: torch.Tensor, y: torch.Tensor, batch_size: int = 8) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


class ProbeAtBatch(pl.Callback):
    """Calls :func:`probe_trainer` in ``on_train_batch_start`` of chosen batches, on every rank.

    ``results``: this process's results; with ``directory`` also ``rank{r}_batch{i}.json`` (spawned workers'
    objects are not the parent's). ``before``/``check`` let a test snapshot and compare around the probe.
    """

    def __init__(self, at: Sequence[int] = (0,), directory: Optional[str] = None, setup=None, check=None, **kwargs: Any):
        self.at = set(at)
        self.directory = directory
        self.setup_fn = setup
        self.check = check
        self.kwargs = {"timing_budget_s": 0.1, **kwargs}  # timing is not what these tests look at
        self.results: dict[int, Any] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx not in self.at:
            return
        if self.setup_fn is not None:
            self.setup_fn(trainer, pl_module, batch_idx)
        before = self.check(trainer, pl_module, None) if self.check else None
        result = probe_trainer(trainer, pl_module, batch, progress_bar=False, **self.kwargs)
        if self.check:
            self.check(trainer, pl_module, before)
        self.results[batch_idx] = result
        if self.directory is not None:
            with open(f"{self.directory}/rank{trainer.global_rank}_batch{batch_idx}.json", "w") as f:
                json.dump(result.to_dict(), f)

    def on_fit_end(self, trainer, pl_module):
        if self.directory is not None:
            with open(f"{self.directory}/rank{trainer.global_rank}_end.json", "w") as f:
                json.dump({"global_step": trainer.global_step}, f)


class RecordingLogger(Logger):
    """Remembers every call it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []
        self.hparams: list[Any] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        self.hparams.append(params)
