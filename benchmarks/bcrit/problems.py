"""The training problems of the critical-batch study: real scikit-learn data, a network, a target loss.

Each problem gives the exact per-step quantities the study needs: ``|G|²`` and ``tr Σ`` over the whole
training set at the current parameters (per-example norms from :class:`PerExampleNormTracker`, the full
gradient from one summed backward pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from gns_callback.per_example import PerExampleNormTracker
from tests.helpers import small_cnn


@dataclass(frozen=True)
class Problem:
    """A data set, a network factory, a target training loss and the LR grid searched per batch size; ``loss`` is
    the per-batch loss (``F.cross_entropy``, or ``F.mse_loss`` for regression), called with ``reduction=``."""

    name: str
    description: str
    make_net: Callable[[], nn.Module]
    data: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    target_loss: float
    lrs: tuple[float, ...]
    optimizer: str = "sgd"
    loss: Callable[..., torch.Tensor] = F.cross_entropy


def digits(train_size: int = 1500, split_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits (pixels/16), a fixed random subset of ``train_size`` images."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(split_seed))[:train_size]
    return x[perm].contiguous(), y[perm].contiguous()


def _standardised(values: torch.Tensor) -> torch.Tensor:
    """Each column at mean 0 and standard deviation 1."""
    return ((values - values.mean(0)) / values.std(0)).contiguous()


def breast_cancer() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's breast-cancer data (569 examples, 30 features standardised, 2 classes), all of it."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    return _standardised(torch.tensor(data.data, dtype=torch.float32)), torch.tensor(data.target)


def diabetes() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's diabetes regression (442 examples, 10 features and the target standardised), all of it."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float32)
    return _standardised(x), _standardised(torch.tensor(data.target, dtype=torch.float32)[:, None])


def wine() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's wine data (178 examples, 13 features standardised, 3 classes), all of it."""
    from sklearn.datasets import load_wine

    data = load_wine()
    return _standardised(torch.tensor(data.data, dtype=torch.float32)), torch.tensor(data.target)


def wine_mlp(hidden: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(13, hidden), nn.Tanh(), nn.Linear(hidden, 3))


def diabetes_mlp(hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def bc_mlp(hidden: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(30, hidden), nn.Tanh(), nn.Linear(hidden, 2))


def mlp(hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))


def cnn(seed: int = 0) -> nn.Module:
    """Conv(8) + GroupNorm + ReLU, strided Conv(8) + ReLU, Linear on 1×8×8 digit images (the tests' small CNN)."""
    return small_cnn(seed=seed)


def lr_grid(low: float, high: float) -> tuple[float, ...]:
    """Log grid with factor √2 from ``low`` to (at most) ``high``."""
    out, k = [], 0
    while low * 2 ** (k / 2) <= high * (1 + 1e-9):
        out.append(round(low * 2 ** (k / 2), 4))
        k += 1
    return tuple(out)


PROBLEMS = {
    "mlp_momentum": Problem("mlp_momentum",
                            "digits MLP 64-64-10 (tanh), SGD momentum 0.9, target full-data cross-entropy 0.05",
                            partial(mlp, 64), digits, 0.05, lr_grid(0.02, 1.6), optimizer="momentum"),
    "mlp": Problem("mlp", "digits MLP 64-64-10 (tanh), SGD, target full-data cross-entropy 0.05",
                   partial(mlp, 64), digits, 0.05, lr_grid(0.1, 2.3)),
    "mlp_adam": Problem("mlp_adam", "digits MLP 64-64-10 (tanh), Adam, target full-data cross-entropy 0.05",
                        partial(mlp, 64), digits, 0.05, lr_grid(0.002, 0.2), optimizer="adam"),
    "cnn_adam": Problem("cnn_adam",
                        "digits CNN (2 conv + GroupNorm + linear, ReLU), Adam, target full-data cross-entropy 0.03",
                        cnn, digits, 0.03, lr_grid(0.001, 0.1), optimizer="adam"),
    # held out: a data set and a network the summary was not chosen on
    "bc_mlp": Problem("bc_mlp", "breast-cancer MLP 30-32-2 (tanh), SGD, target full-data cross-entropy 0.02",
                      bc_mlp, breast_cancer, 0.02, lr_grid(0.2, 9.1)),
    "bc_mlp_adam": Problem("bc_mlp_adam", "breast-cancer MLP 30-32-2 (tanh), Adam, target full-data cross-entropy 0.02",
                           bc_mlp, breast_cancer, 0.02, lr_grid(0.002, 0.2), optimizer="adam"),
    "bc_mlp_momentum": Problem("bc_mlp_momentum",
                               "breast-cancer MLP 30-32-2 (tanh), SGD momentum 0.9, target full-data cross-entropy 0.02",
                               bc_mlp, breast_cancer, 0.02, lr_grid(0.02, 1.6), optimizer="momentum"),
    "wine_mlp": Problem("wine_mlp", "wine MLP 13-32-3 (tanh), SGD, target full-data cross-entropy 0.02",
                        wine_mlp, wine, 0.02, lr_grid(0.2, 9.1)),
    "wine_mlp_adam": Problem("wine_mlp_adam", "wine MLP 13-32-3 (tanh), Adam, target full-data cross-entropy 0.02",
                             wine_mlp, wine, 0.02, lr_grid(0.002, 0.2), optimizer="adam"),
    "wine_mlp_momentum": Problem("wine_mlp_momentum",
                                 "wine MLP 13-32-3 (tanh), SGD momentum 0.9, target full-data cross-entropy 0.02",
                                 wine_mlp, wine, 0.02, lr_grid(0.02, 1.6), optimizer="momentum"),
    "diabetes_mlp": Problem("diabetes_mlp", "diabetes MLP 10-64-64-1 (tanh), regression, SGD, target full-data MSE 0.25 "
                            "(standardised target)", diabetes_mlp, diabetes, 0.25, lr_grid(0.01, 0.32), loss=F.mse_loss),
    "cnn": Problem("cnn", "digits CNN (2 conv + GroupNorm + linear, ReLU), SGD, target full-data cross-entropy 0.03",
                   cnn, digits, 0.03, lr_grid(0.05, 0.8)),
}


class ExactSums:
    """Exact ``(|G|², tr Σ)`` of a network over a whole data set at its current parameters.

    ``tr Σ = mean_i |g_i|² − |G|²`` (sampling with replacement), ``G = mean_i g_i``; the per-example squared
    norms come from the tracker, without materialising per-example gradients.
    """

    def __init__(self, tracker: PerExampleNormTracker, x: torch.Tensor, y: torch.Tensor,
                 loss: Callable[..., torch.Tensor] = F.cross_entropy) -> None:
        self.tracker, self.x, self.y, self.loss = tracker, x, y, loss

    def __call__(self, net: nn.Module) -> tuple[float, float]:
        saved = self.tracker.max_examples
        self.tracker.max_examples = None
        params = [p for p in net.parameters() if p.requires_grad]
        kept = [p.grad for p in params]
        for p in params:  # the tracker reads passes that fill .grad (not torch.autograd.grad's)
            p.grad = None
        self.loss(net(self.x), self.y, reduction="sum").backward()
        grads = [p.grad for p in params]
        sq = self.tracker.pop().double()
        for p, g in zip(params, kept):
            p.grad = g
        self.tracker.max_examples = saved
        n = len(self.x)
        grad_sq = sum(g.double().pow(2).sum() for g in grads).item() / n**2
        return grad_sq, sq.mean().item() - grad_sq
