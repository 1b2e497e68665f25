"""Small models, loaders and Trainer settings shared by the tests."""

from __future__ import annotations

import gc
import types

import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset


def quiet_trainer(**kwargs) -> pl.Trainer:
    """A CPU Trainer with no logger, checkpointing, progress bar or model summary (unless overridden)."""
    settings = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    settings.update(kwargs)
    return pl.Trainer(**settings)


def with_replacement_loader(x, y, batch_size: int, num_samples: int, seed: int = 0) -> DataLoader:
    """Batches drawn i.i.d. with replacement: the sampling the unbiased estimators assume."""
    generator = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(range(len(x)), replacement=True, num_samples=num_samples, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, sampler=sampler)


def mlp(in_dim: int = 64, hidden: int = 32, classes: int = 10, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(in_dim, hidden), nn.Tanh(), nn.Linear(hidden, classes))


def small_cnn(classes: int = 10, seed: int = 0) -> nn.Module:
    """Conv + GroupNorm on 1×8×8 digit images."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.GroupNorm(2, 8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, classes),
    )


#: The optimizers :func:`optimizer_for` builds by name (PyTorch defaults but for the ones named).
OPTIMIZERS = {
    "sgd": lambda params, lr: torch.optim.SGD(params, lr=lr),
    "momentum": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9),
    "nesterov": lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True),
    "adam": lambda params, lr: torch.optim.Adam(params, lr=lr),
    "adamw": lambda params, lr: torch.optim.AdamW(params, lr=lr, weight_decay=0.01),
    "rmsprop": lambda params, lr: torch.optim.RMSprop(params, lr=lr),
    "adagrad": lambda params, lr: torch.optim.Adagrad(params, lr=lr),
    "adadelta": lambda params, lr: torch.optim.Adadelta(params, lr=lr),
    "adafactor": lambda params, lr: torch.optim.Adafactor(params, lr=lr),
}


def optimizer_for(name: str, params, lr: float) -> torch.optim.Optimizer:
    """An optimizer by its name (:data:`OPTIMIZERS`): ``"sgd"``, ``"momentum"`` (SGD, momentum 0.9), ``"nesterov"``
    (SGD, Nesterov momentum 0.9), ``"adam"``, ``"adamw"`` (weight decay 0.01), ``"rmsprop"``, ``"adagrad"``, ``"adadelta"`` or
    ``"adafactor"``."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name](params, lr)


class LearnedSlope(nn.Module):
    """A module of its own holding a parameter no layer function reads (``F.prelu`` on a bare slope): left out."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((1,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.prelu(x, self.weight)


class Classifier(pl.LightningModule):
    """Wraps a network with cross-entropy; ``lr=0`` keeps the parameters fixed (exact-value tests).

    ``loader_args`` (if given) builds a with-replacement loader inside the process, seeded by rank, so the
    same module works under ``ddp_spawn`` with ``use_distributed_sampler=False``.
    """

    def __init__(self, net: nn.Module, lr: float = 0.0, loss_reduction: str = "mean", loader_args: dict | None = None,
                 optimizer: str = "sgd", loss_fn=F.cross_entropy) -> None:
        super().__init__()
        self.net = net
        self.lr = lr
        self.loss_reduction = loss_reduction
        self.loader_args = loader_args
        self.optimizer = optimizer
        self.loss_fn = loss_fn

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return self.loss_fn(self.net(x), y, reduction=self.loss_reduction)

    def configure_optimizers(self):
        return optimizer_for(self.optimizer, self.parameters(), self.lr)

    def train_dataloader(self):
        args = dict(self.loader_args)
        args["seed"] = args.get("seed", 0) + 1000 * self.global_rank
        return with_replacement_loader(**args)


def fit_with_gns(net, x, y, *, accumulate=4, batch_size=8, steps=300, seed=1, callback=None, module_kwargs=None, **trainer_kwargs):
    """Fit ``Classifier(net)`` for ``steps`` optimizer steps of i.i.d. batches; return (callback, trainer, module)."""
    from gns_callback import GradientNoiseScaleCallback

    callback = callback or GradientNoiseScaleCallback(method="micro_batch", verbose=False)
    loader = with_replacement_loader(x, y, batch_size, accumulate * batch_size * steps, seed=seed)
    module = Classifier(net, **(module_kwargs or {}))
    trainer_kwargs.setdefault("callbacks", [])
    trainer_kwargs["callbacks"] = [callback, *trainer_kwargs["callbacks"]]
    trainer = quiet_trainer(accumulate_grad_batches=accumulate, **trainer_kwargs)
    trainer.fit(module, loader)
    return callback, trainer, module


def assert_matches_exact(estimate, exact: float, max_ci_ratio: float = 2.0) -> None:
    """The exact value lies inside the reported interval, and that interval is informative.

    The interval is the estimator's own standard error at work (calibrated in tests/test_confidence.py); the
    width bound makes sure a test cannot pass by reporting a uselessly wide interval.
    """
    assert estimate.steps > 0
    assert estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact)
    assert estimate.ci_high / estimate.ci_low < max_ci_ratio, estimate


class TokenModel(nn.Module):
    """Embedding → LayerNorm → Linear over the sequence → mean-pool → Linear (input: (B, T) token ids)."""

    def __init__(self, vocab: int = 17, dim: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        h = torch.tanh(self.mix(self.norm(self.embed(tokens))))
        return self.head(h.mean(dim=1))


def token_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TokenModel()


def bn_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 10))


def package_objects_reachable(root: object) -> list[str]:
    """The types of gns_callback's objects (a tracker, a collector, a meter, a hook of ours) that ``root`` refers to,
    directly or not; classes, functions and modules are not followed (through them everything is reachable)."""
    found, seen, todo = set(), set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if type(obj).__module__.startswith("gns_callback"):
            found.add(type(obj).__qualname__)
        todo.extend(gc.get_referents(obj))
    return sorted(found)


def module_hooks(model: nn.Module) -> list[object]:
    """Every hook on ``model``'s modules and parameters."""
    return [hook for module in model.modules()
            for hooks in (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                          module._backward_pre_hooks) for hook in hooks.values()] + [
        hook for param in model.parameters()
        for hooks in (param._backward_hooks or {}, getattr(param, "_post_accumulate_grad_hooks", None) or {})
        for hook in hooks.values()]
