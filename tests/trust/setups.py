"""Run a setup twice: without the callback (it trains on its own), then with it. Shared by the trust tests."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback, GradientNoiseScaleMeter
from tests.helpers import Classifier, assert_matches_exact, quiet_trainer, with_replacement_loader

BASELINE_STEPS = 5


def fit(module: pl.LightningModule, loaders: Any, ours: tuple = (), **trainer_kwargs: Any) -> pl.Trainer:
    """``loaders``: the train DataLoader, or ``{"train_dataloaders": ..., "val_dataloaders": ...}``; ``ours``: our
    callback(s), put before the user's ``callbacks``."""
    trainer_kwargs["callbacks"] = [*ours, *trainer_kwargs.get("callbacks", [])]
    trainer = quiet_trainer(**trainer_kwargs)
    trainer.fit(module, **(loaders if isinstance(loaders, dict) else {"train_dataloaders": loaders}))
    return trainer


def trains_without_callback(make_module: Callable[[], pl.LightningModule], make_loader: Callable[[], Any],
                            steps: int = BASELINE_STEPS, **trainer_kwargs: Any) -> pl.Trainer:
    """The setup itself trains: ``steps`` optimizer steps and fit end, with no callback of ours (every crash of the
    issue happened at the first step or at fit end, so a short run proves the point at a fraction of the cost)."""
    trainer = fit(make_module(), make_loader(), max_steps=steps, **trainer_kwargs)
    assert trainer.state.finished and trainer.global_step == steps, (trainer.state, trainer.global_step)
    return trainer


def with_and_without(make_module: Callable[[], pl.LightningModule], make_loader: Callable[[], Any], callback: Any,
                     **trainer_kwargs: Any) -> tuple[pl.Trainer, list[warnings.WarningMessage]]:
    """Fit without the callback (:func:`trains_without_callback`), then with it for the whole loader; the second
    trainer and every warning it raised."""
    trains_without_callback(make_module, make_loader, **trainer_kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(make_module(), make_loader(), (callback,), **trainer_kwargs)
    assert trainer.state.finished
    return trainer, list(caught)


def messages(caught: list[warnings.WarningMessage], containing: str) -> list[str]:
    return [str(w.message) for w in caught if containing in str(w.message)]


def assert_withheld(estimate: Any, *phrases: str) -> None:
    """"Not measured": NaN with the reason, which names each of ``phrases`` (the problem and the fix)."""
    assert not estimate.measured and estimate.failure, estimate
    assert estimate.to_dict()["b_simple"] is None
    for phrase in phrases:
        assert phrase in estimate.failure, (phrase, estimate.failure)


def single(items: list[str], what: Optional[str] = None) -> str:
    assert len(items) == 1, (what, items)
    return items[0]


def scaled_and_unscaled(make_model: Callable[[], Any], x: Any, y: Any, steps: int) -> list[Any]:
    """Framework-free meters (lr 0) over the same ``steps`` batches of 32, without and with a real CPU GradScaler
    (the loss scaled by 2^16, the gradients unscaled before the step, the scale handed to the meter): their run
    estimates, and each meter's coverage fraction, as ``[(estimate, fraction), …]``."""
    batches = torch.randint(0, len(x), (steps, 32), generator=torch.Generator().manual_seed(0))
    results = []
    for scaled in (False, True):
        model = make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", enabled=scaled)
        with GradientNoiseScaleMeter(model) as meter:
            for index in batches:
                optimizer.zero_grad()
                scaler.scale(F.cross_entropy(model(x[index]), y[index])).backward()
                scaler.unscale_(optimizer)
                meter.step(loss_scale=scaler.get_scale() if scaled else None)
                scaler.step(optimizer)
                scaler.update()
            results.append((meter.run_estimate, meter.coverage["fraction"]))
    assert scaler.get_scale() > 1.0
    return results


def float32_and_bf16(make_model: Callable[[], Any], x: Any, y: Any, report_dir: Any, steps: int = 40) -> list[Any]:
    """Run estimates of two Lightning fits at the defaults on the same ``steps`` batches of 32, at "32-true" and
    "bf16-mixed", each covering the whole model."""
    estimates = []
    for precision in ("32-true", "bf16-mixed"):
        callback = GradientNoiseScaleCallback(report_path=str(report_dir / "report.json"), verbose=False)
        quiet_trainer(callbacks=[callback], precision=precision).fit(
            Classifier(make_model()), with_replacement_loader(x, y, 32, 32 * steps, seed=0))
        assert callback.meter.coverage["fraction"] == 1.0
        estimates.append(callback.run_estimate)
    assert estimates[1].steps == steps
    return estimates


def assert_fit_measures_whole(make_model: Callable[[], Any], x: Any, y: Any, exact_gns: Callable[..., Any],
                              report_dir: Any, steps: int = 150) -> None:
    """A Lightning fit at the defaults, one micro-batch of 32 per step for ``steps`` steps at fixed parameters (the
    run the same with and without the callback): per-example norms cover the whole model, the exact value lies in
    the interval, and a batch is recommended."""
    callback = GradientNoiseScaleCallback(report_path=str(report_dir / "report.json"), verbose=False)
    with_and_without(lambda: Classifier(make_model()), lambda: with_replacement_loader(x, y, 32, 32 * steps),
                     callback)
    assert callback.run_estimate.method == "per_example" and callback.meter.coverage["fraction"] == 1.0
    assert_matches_exact(callback.run_estimate, exact_gns(make_model(), F.cross_entropy, x, y)[0], max_ci_ratio=3.0)
    assert callback.recommendation.status not in ("partial_coverage", "too_wide")

