"""SharpnessMonitor: λ_max during a fit against the exact Hessian, and a fit left bit-identical by it."""

import warnings

import pytest
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from gns_callback import GradientNoiseScaleCallback
from gns_callback.lightning import sharpness as sharpness_module
from gns_callback.lightning.sharpness import DEFAULT_STEPS, SharpnessMonitor
from tests.helpers import quiet_trainer, with_replacement_loader
from tests.probe.models import RecordingLogger


class Net(pl.LightningModule):
    """An MLP with optional BatchNorm and dropout, a torchmetrics metric, ``self.log`` and a list of outputs."""

    def __init__(self, optimizer="sgd", lr=0.3, batch_norm=True, dropout=0.2, seed=0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        layers = [nn.Linear(64, 16)] + ([nn.BatchNorm1d(16)] if batch_norm else []) + [nn.Tanh()]
        layers += [nn.Dropout(dropout)] if dropout else []
        self.net = nn.Sequential(*layers, nn.Linear(16, 10)).to(dtype)
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10)
        self.optimizer, self.lr = optimizer, lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x.to(next(self.parameters()).dtype))
        loss = F.cross_entropy(logits, y)
        self.accuracy(logits.float(), y)
        self.log("train_loss", loss)
        self.log("train_acc", self.accuracy)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self):
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=self.lr / 100)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Measure(pl.Callback):
    """Calls the monitor from ``on_train_batch_start`` (the one line the callback will hold), after keeping the
    batch and a copy of the parameters for an exact check."""

    def __init__(self, monitor):
        self.monitor = monitor
        self.seen = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen[trainer.global_step] = (batch, [p.detach().clone() for p in pl_module.parameters()])
        self.monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx)


def _fit(digits, module, callbacks=(), steps=40, batch_size=16, accumulate=1, logger=None, seed=3):
    x, y = digits
    pl.seed_everything(seed, verbose=False)
    loader = with_replacement_loader(x, y, batch_size, batch_size * accumulate * steps, seed=seed)
    trainer = quiet_trainer(callbacks=list(callbacks), accumulate_grad_batches=accumulate,
                            logger=logger or False, log_every_n_steps=1)
    trainer.fit(module, loader)
    return trainer


def _exact_top_eigenvalue(module, params, batch):
    """Top eigenvalue of ``torch.autograd.functional.hessian`` of the batch loss at ``params`` (eval-free: the
    model has no BatchNorm or dropout here)."""
    names = [n for n, _ in module.net.named_parameters()]
    shapes = [p.shape for p in params]
    x, y = batch

    def loss(theta):
        chunks, start = {}, 0
        for name, shape in zip(names, shapes):
            chunks[name] = theta[start:start + shape.numel()].reshape(shape)
            start += shape.numel()
        return F.cross_entropy(functional_call(module.net, chunks, (x.double(),)), y)

    flat = torch.cat([p.reshape(-1) for p in params])
    return float(torch.linalg.eigvalsh(torch.autograd.functional.hessian(loss, flat))[-1])


# ---------------------------------------------------------------------------------------------- values
@pytest.mark.parametrize("budget", [dict(max_iterations=200, rtol=1e-10), dict()])
def test_each_measurement_is_the_top_hessian_eigenvalue_of_that_steps_batch(digits, budget):
    """Converged, every value equals the exact top eigenvalue to 1e-6; with the default budget (at most 30
    Lanczos products, Ritz residual ≤ 1e-3·λ) within 0.5%."""
    module = Net(batch_norm=False, dropout=0.0, dtype=torch.float64, lr=0.2)
    monitor = SharpnessMonitor(steps=(0, 3, 9), **budget)
    measure = Measure(monitor)
    _fit(digits, module, [measure], steps=12)
    assert [s for s, _ in monitor.measurements] == [0, 3, 9]
    tolerance = 1e-6 if budget else 5e-3
    for step, value in monitor.measurements:
        batch, params = measure.seen[step]
        exact = _exact_top_eigenvalue(module, params, batch)
        assert value == pytest.approx(exact, rel=tolerance), (step, value, exact)
    assert monitor.largest == max(v for _, v in monitor.measurements)


def test_measures_only_at_window_starts_on_the_schedule(digits):
    """With accumulation, at the first micro-batch of the first optimizer step at or after each scheduled step."""
    monitor = SharpnessMonitor(steps=(2, 5, 1000))
    _fit(digits, Net(), [Measure(monitor)], steps=8, accumulate=3)
    assert [s for s, _ in monitor.measurements] == [2, 5]


# ---------------------------------------------------------------------------------------------- the run untouched
def _run_state(trainer, module, logger):
    optimizer = trainer.optimizers[0]
    return {
        "params": {k: v.clone() for k, v in module.state_dict().items()},  # BN running stats included
        "grads": [None if p.grad is None else p.grad.clone() for p in module.parameters()],
        "momentum": [optimizer.state[p]["momentum_buffer"].clone() for p in module.parameters()],
        "metrics": logger.metrics,
        "callback_metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
        "losses": list(module.losses),
        "accuracy_state": {k: v.clone() for k, v in module.accuracy.metric_state.items()},
        "rng": torch.rand(5),
    }


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict) and all(isinstance(v, torch.Tensor) for v in a[key].values()):
            for name in a[key]:
                assert torch.equal(a[key][name], b[key][name]), (key, name)
        elif isinstance(a[key], list) and a[key] and isinstance(a[key][0], torch.Tensor):
            assert all(torch.equal(u, v) for u, v in zip(a[key], b[key])), key
        elif isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


def test_a_fit_with_the_monitor_is_bit_identical_to_one_without(digits):
    """Weights, BatchNorm statistics, momentum buffers, .grad, logged values, torchmetrics state, user lists and
    the RNG draws after the fit: all equal with and without five measurements (BatchNorm and dropout on)."""
    runs = []
    for monitor in (None, SharpnessMonitor(steps=(1, 2, 4, 8, 16))):
        module, logger = Net(), RecordingLogger()
        trainer = _fit(digits, module, [Measure(monitor)] if monitor else [], steps=20, logger=logger)
        runs.append(_run_state(trainer, module, logger))
    assert len(monitor.measurements) == 5 and monitor.largest > 0  # it did run
    _assert_same(*runs)


def test_the_gns_meter_sees_nothing_of_the_passes_when_paused(digits):
    """Inside the GNS callback (quiet = the meter's ``paused``) the per-example meter keeps measuring and its
    estimate is identical to the run without the monitor. Without pausing, the per-example hooks see the
    create_graph pass and stop: pausing is needed."""

    class WithSharpness(GradientNoiseScaleCallback):
        def __init__(self, pause, **kwargs):
            super().__init__(**kwargs)
            self.monitor, self.pause = SharpnessMonitor(steps=(1, 4, 9)), pause

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            quiet = self.meter.paused if self.pause else sharpness_module.nullcontext
            self.monitor.on_train_batch_start(trainer, pl_module, batch, batch_idx, quiet=quiet)

    options = dict(method="per_example", verbose=False, recommend=False)
    estimates = []
    for callback in (GradientNoiseScaleCallback(**options), WithSharpness(True, **options)):
        _fit(digits, Net(batch_norm=False), [callback], steps=12, accumulate=2)
        estimates.append(callback.run_estimate)
    assert callback.monitor.largest is not None
    assert estimates[0].steps == estimates[1].steps == 12
    assert estimates[0].failure is None and estimates[1].failure is None
    assert (estimates[0].b_simple, estimates[0].grad_sq_norm, estimates[0].trace_sigma) == (
        estimates[1].b_simple, estimates[1].grad_sq_norm, estimates[1].trace_sigma)

    unpaused = WithSharpness(False, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _fit(digits, Net(batch_norm=False), [unpaused], steps=12, accumulate=2)
    assert unpaused.run_estimate.failure is not None and "create_graph" in unpaused.run_estimate.failure


# ---------------------------------------------------------------------------------------------- when it runs
def test_it_does_not_run_for_adam(digits, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("measured for Adam")

    monkeypatch.setattr(sharpness_module, "lanczos_top_eigenvalue", forbidden)
    monitor = SharpnessMonitor(steps=(0, 1, 2))
    _fit(digits, Net(optimizer="adam"), [Measure(monitor)], steps=4)
    assert monitor.measurements == [] and monitor.largest is None and monitor.failure is None


def test_an_explicit_sgd_rule_measures_even_for_adam(digits):
    monitor = SharpnessMonitor(steps=(1,), lr_rule="linear")
    _fit(digits, Net(optimizer="adam"), [Measure(monitor)], steps=3)
    assert len(monitor.measurements) == 1


def test_a_failure_warns_once_leaves_largest_none_and_the_run_unchanged(digits, monkeypatch):
    calls = []

    def fail_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    real = sharpness_module.lanczos_top_eigenvalue
    reference, logger = Net(), RecordingLogger()
    _fit(digits, reference, [], steps=10, logger=logger)
    monkeypatch.setattr(sharpness_module, "lanczos_top_eigenvalue", fail_second)
    monitor, module = SharpnessMonitor(steps=(1, 2, 4, 8)), Net()
    with pytest.warns(RuntimeWarning, match="λ_max not measured.*RuntimeError: boom") as record:
        _fit(digits, module, [Measure(monitor)], steps=10, logger=RecordingLogger())
    assert len([w for w in record if "λ_max" in str(w.message)]) == 1
    assert len(calls) == 2 and monitor.largest is None
    for a, b in zip(reference.state_dict().values(), module.state_dict().values()):
        assert torch.equal(a, b)


def test_a_non_finite_value_is_a_failure(digits, monkeypatch):
    monkeypatch.setattr(sharpness_module, "lanczos_top_eigenvalue",
                        lambda hvp, start, **kw: float("nan"))
    monitor = SharpnessMonitor(steps=(1,))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        _fit(digits, Net(), [Measure(monitor)], steps=3)
    assert monitor.largest is None


# ---------------------------------------------------------------------------------------------- state and input
def test_state_dict_round_trip_and_resume_continues_the_schedule():
    monitor = SharpnessMonitor(steps=(4, 16, 64))
    monitor.measurements = [(4, 2.5), (16, 3.0)]
    restored = SharpnessMonitor(steps=(4, 16, 64))
    restored.load_state_dict(monitor.state_dict())
    assert restored.largest == 3.0 and restored.measurements == monitor.measurements
    assert not restored._due(63) and restored._due(64) and restored._due(70)
    with pytest.raises(ValueError, match="version"):
        restored.load_state_dict({"version": 99})


def test_state_dict_survives_a_weights_only_checkpoint(tmp_path):
    monitor = SharpnessMonitor()
    monitor.measurements = [(4, 1.25)]
    torch.save({"sharpness": monitor.state_dict()}, tmp_path / "c.pt")
    loaded = torch.load(tmp_path / "c.pt", weights_only=True)["sharpness"]
    restored = SharpnessMonitor()
    restored.load_state_dict(loaded)
    assert restored.largest == 1.25


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=()), "steps="), (dict(steps=(4, -1)), "steps="), (dict(steps=(2.5,)), "steps="),
    (dict(max_iterations=0), "max_iterations="), (dict(rtol=0.0), "rtol="), (dict(lr_rule="fast"), "lr_rule"),
])
def test_bad_settings_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SharpnessMonitor(**kwargs)


def test_default_schedule_is_doublings_from_4_to_1024():
    assert DEFAULT_STEPS == tuple(4 * 2**k for k in range(9))


class AttentionNet(Net):
    """Digits as 8 rows of 8 through ``nn.TransformerEncoderLayer`` (its attention by
    ``scaled_dot_product_attention``), mean-pooled into a Linear head."""

    def __init__(self):
        super().__init__(batch_norm=False, dropout=0.0, dtype=torch.float64, lr=0.2)
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Unflatten(1, (8, 8)),
                                 nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                                 nn.Flatten(), nn.Linear(64, 10)).double()


def test_attention_is_measured_by_the_math_kernel(digits):
    """The CPU's fused attention kernel has no double backward: before, λ_max of any model with
    ``nn.MultiheadAttention`` was never measured on the CPU ("derivative for
    aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented")."""
    module = AttentionNet()
    monitor = SharpnessMonitor(steps=(0,), max_iterations=200, rtol=1e-10)
    measure = Measure(monitor)
    _fit(digits, module, [measure], steps=2)
    assert monitor.failure is None and [s for s, _ in monitor.measurements] == [0]
    batch, params = measure.seen[0]
    with sdpa_kernel(SDPBackend.MATH):
        exact = _exact_top_eigenvalue(module, params, batch)
    assert monitor.largest == pytest.approx(exact, rel=1e-6)
