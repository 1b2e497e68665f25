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


def _classification(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's bundled classification data set ``load_<name>``, all of it, features standardised."""
    import sklearn.datasets

    data = getattr(sklearn.datasets, f"load_{name}")()
    return _standardised(torch.tensor(data.data, dtype=torch.float32)), torch.tensor(data.target)


def breast_cancer() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's breast-cancer data (569 examples, 30 features standardised, 2 classes), all of it."""
    return _classification("breast_cancer")


def diabetes() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's diabetes regression (442 examples, 10 features and the target standardised), all of it."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float32)
    return _standardised(x), _standardised(torch.tensor(data.target, dtype=torch.float32)[:, None])


def wine() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's wine data (178 examples, 13 features standardised, 3 classes), all of it."""
    return _classification("wine")


def _tanh_mlp(inputs: int, classes: int, hidden: int = 32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, classes))


bc_mlp = partial(_tanh_mlp, 30, 2)
wine_mlp = partial(_tanh_mlp, 13, 3)


def diabetes_mlp(hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))


def mlp(hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))


def cnn(seed: int = 0) -> nn.Module:
    """Conv(8) + GroupNorm + ReLU, strided Conv(8) + ReLU, Linear on 1×8×8 digit images (the tests' small CNN)."""
    return small_cnn(seed=seed)


def cnn_bn(seed: int = 0) -> nn.Module:
    """:func:`cnn` with ``BatchNorm2d(8)`` in place of ``GroupNorm(2, 8)`` (same initial weights: neither norm draws
    random numbers at construction). Trained in train mode (batch statistics); the target loss is read in eval mode
    (running statistics, :func:`benchmarks.bcrit.training.full_loss`)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


class GhostBatchNorm2d(nn.BatchNorm2d):
    """``BatchNorm2d`` that, in train mode, normalises each of ``chunks`` equal parts of the batch over its own
    statistics (running statistics updated once per part): the same step as ``accumulate_grad_batches=chunks`` at
    the same global batch, where each backward pass sees one part."""

    def __init__(self, features: int, chunks: int = 2) -> None:
        super().__init__(features)
        self.chunks = chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        return torch.cat([super(GhostBatchNorm2d, self).forward(part) for part in x.chunk(self.chunks)])


def cnn_bn_ghost2(seed: int = 0) -> nn.Module:
    """:func:`cnn_bn` whose BatchNorm normalises each half of the batch on its own (:class:`GhostBatchNorm2d`)."""
    net = cnn_bn(seed)
    net[2] = GhostBatchNorm2d(8, 2)
    return net


def lr_grid(low: float, high: float) -> tuple[float, ...]:
    """Log grid with factor √2 from ``low`` to (at most) ``high``."""
    out, k = [], 0
    while low * 2 ** (k / 2) <= high * (1 + 1e-9):
        out.append(round(low * 2 ** (k / 2), 4))
        k += 1
    return tuple(out)


def _held_out(key: str, network: str, make_net: Callable[[], nn.Module],
              data: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Problem]:
    """A held-out classification problem (target full-data cross-entropy 0.02) under SGD, Adam, SGD with
    momentum 0.9, RMSprop and Adagrad: keys ``key``, ``key_adam``, ``key_momentum``, ``key_rmsprop``, ``key_adagrad``,
    each with its optimizer's LR grid."""
    runs = (("", "SGD", "sgd", lr_grid(0.2, 9.1)), ("_adam", "Adam", "adam", lr_grid(0.002, 0.2)),
            ("_momentum", "SGD momentum 0.9", "momentum", lr_grid(0.02, 1.6)),
            ("_rmsprop", "RMSprop", "rmsprop", lr_grid(0.001, 0.1)), ("_adagrad", "Adagrad", "adagrad", lr_grid(0.01, 1.0)))
    return {key + suffix: Problem(key + suffix, f"{network}, {label}, target full-data cross-entropy 0.02", make_net,
                                  data, 0.02, lrs, optimizer=optimizer)
            for suffix, label, optimizer, lrs in runs}


PROBLEMS = {
    "mlp_momentum": Problem("mlp_momentum",
                            "digits MLP 64-64-10 (tanh), SGD momentum 0.9, target full-data cross-entropy 0.05",
                            partial(mlp, 64), digits, 0.05, lr_grid(0.02, 1.6), optimizer="momentum"),
    "mlp": Problem("mlp", "digits MLP 64-64-10 (tanh), SGD, target full-data cross-entropy 0.05",
                   partial(mlp, 64), digits, 0.05, lr_grid(0.1, 2.3)),
    "mlp_adam": Problem("mlp_adam", "digits MLP 64-64-10 (tanh), Adam, target full-data cross-entropy 0.05",
                        partial(mlp, 64), digits, 0.05, lr_grid(0.002, 0.2), optimizer="adam"),
    # optimizers the calibration never saw (the digits MLP; bc_mlp_* below: a held-out data set too)
    **{f"mlp_{key}": Problem(f"mlp_{key}", f"digits MLP 64-64-10 (tanh), {label}, target full-data cross-entropy 0.05",
                             partial(mlp, 64), digits, 0.05, lrs, optimizer=key)
       for key, label, lrs in (("nesterov", "SGD Nesterov momentum 0.9", lr_grid(0.02, 1.6)),
                               ("adamw", "AdamW weight decay 0.01", lr_grid(0.002, 0.2)),
                               ("rmsprop", "RMSprop", lr_grid(0.0005, 0.05)),
                               ("adagrad", "Adagrad", lr_grid(0.005, 0.5)),
                               ("adadelta", "Adadelta", lr_grid(0.1, 10.0)),
                               ("adafactor", "Adafactor", lr_grid(0.001, 0.1)))},
    "cnn_adam": Problem("cnn_adam",
                        "digits CNN (2 conv + GroupNorm + linear, ReLU), Adam, target full-data cross-entropy 0.03",
                        cnn, digits, 0.03, lr_grid(0.001, 0.1), optimizer="adam"),
    # held out: a data set and a network the summary was not chosen on
    **_held_out("bc_mlp", "breast-cancer MLP 30-32-2 (tanh)", bc_mlp, breast_cancer),
    **_held_out("wine_mlp", "wine MLP 13-32-3 (tanh)", wine_mlp, wine),
    "diabetes_mlp": Problem("diabetes_mlp", "diabetes MLP 10-64-64-1 (tanh), regression, SGD, target full-data MSE 0.25 "
                            "(standardised target)", diabetes_mlp, diabetes, 0.25, lr_grid(0.01, 0.32), loss=F.mse_loss),
    "cnn": Problem("cnn", "digits CNN (2 conv + GroupNorm + linear, ReLU), SGD, target full-data cross-entropy 0.03",
                   cnn, digits, 0.03, lr_grid(0.05, 0.8)),
    # BatchNorm in training mode (the examples of a batch coupled through its statistics)
    "cnn_bn": Problem("cnn_bn", "digits CNN (2 conv + BatchNorm + linear, ReLU), SGD, target full-data cross-entropy "
                      "0.03 (eval mode)", cnn_bn, digits, 0.03, lr_grid(0.1, 1.6)),
    "cnn_bn_momentum": Problem("cnn_bn_momentum", "digits CNN (2 conv + BatchNorm + linear, ReLU), SGD momentum 0.9, "
                               "target full-data cross-entropy 0.03 (eval mode)", cnn_bn, digits, 0.03,
                               lr_grid(0.01, 0.32), optimizer="momentum"),
    # what accumulate_grad_batches=2 at the same global batch trains (BatchNorm over each half); slow way only
    "cnn_bn_ghost2": Problem("cnn_bn_ghost2", "digits CNN (2 conv + BatchNorm over each half of the batch + linear, "
                             "ReLU), SGD, target full-data cross-entropy 0.03 (eval mode)", cnn_bn_ghost2, digits, 0.03,
                             lr_grid(0.1, 1.6)),
    "cnn_bn_ghost2_momentum": Problem("cnn_bn_ghost2_momentum", "digits CNN (2 conv + BatchNorm over each half of the "
                                      "batch + linear, ReLU), SGD momentum 0.9, target full-data cross-entropy 0.03 "
                                      "(eval mode)", cnn_bn_ghost2, digits, 0.03, lr_grid(0.01, 0.32),
                                      optimizer="momentum"),
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
        buffers = [b.clone() for b in net.buffers()]  # BatchNorm's running statistics: the training run's own
        kept = [p.grad for p in params]
        for p in params:  # the tracker reads passes that fill .grad (not torch.autograd.grad's)
            p.grad = None
        self.loss(net(self.x), self.y, reduction="sum").backward()
        grads = [p.grad for p in params]
        sq = self.tracker.pop().double()
        for p, g in zip(params, kept):
            p.grad = g
        self.tracker.max_examples = saved
        for b, v in zip(net.buffers(), buffers):
            b.copy_(v)
        n = len(self.x)
        grad_sq = sum(g.double().pow(2).sum() for g in grads).item() / n**2
        return grad_sq, sq.mean().item() - grad_sq
