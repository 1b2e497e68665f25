"""A digits classifier as a LightningModule of either namespace (a Trainer only fits its own namespace's modules).

Its constructor takes plain types only, so LightningCLI can build it from YAML; it brings its own loader of
i.i.d. batches (drawn with replacement, the sampling the estimators assume).
"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

from tests.helpers import with_replacement_loader


def digits_tensors() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled digits, pixels in [0, 1] (as the ``digits`` fixture)."""
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def digits_net(hidden: int = 32, batch_norm: bool = False, seed: int = 0) -> nn.Module:
    """64 → hidden (→ BatchNorm) → tanh → 10, initialised from ``seed``."""
    torch.manual_seed(seed)
    norm = [nn.BatchNorm1d(hidden)] if batch_norm else []
    return nn.Sequential(nn.Linear(64, hidden), *norm, nn.Tanh(), nn.Linear(hidden, 10))


@functools.cache
def digits_classifier(namespace: str) -> type:
    """The ``DigitsClassifier`` class for ``namespace`` (``"pytorch_lightning"`` or ``"lightning.pytorch"``)."""
    base = importlib.import_module(namespace).LightningModule

    class DigitsClassifier(base):
        """Cross-entropy on digits; ``lr=0`` keeps the parameters fixed (exact-value tests). ``micro_batches``
        batches of ``batch_size`` make one epoch."""

        def __init__(self, hidden: int = 32, batch_norm: bool = False, lr: float = 0.0, batch_size: int = 32,
                     micro_batches: int = 40, seed: int = 0) -> None:
            super().__init__()
            self.net = digits_net(hidden, batch_norm, seed)
            self.lr, self.batch_size, self.micro_batches, self.seed = lr, batch_size, micro_batches, seed

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr)

        def train_dataloader(self):
            x, y = digits_tensors()
            return with_replacement_loader(x, y, self.batch_size, self.batch_size * self.micro_batches, seed=self.seed)

    DigitsClassifier.__qualname__ = f"DigitsClassifier[{namespace}]"
    return DigitsClassifier
