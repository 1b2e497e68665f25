"""GradientNoiseScaleCallback end to end against the exact B_simple computed by brute force.

Parameters are held fixed (SGD with lr=0) and batches drawn with replacement, so every step samples the same
distribution whose exact noise scale the reference computes from all 1797 per-example gradients.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import GradientAccumulationScheduler
from pytorch_lightning.loggers import Logger
from pytorch_lightning.plugins.precision import MixedPrecision
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from gns_callback import GradientNoiseScaleCallback, load_estimate
from tests.helpers import Classifier, assert_matches_exact, fit_with_gns, mlp, quiet_trainer, small_cnn, with_replacement_loader


@pytest.fixture(scope="module")
def mlp_exact(digits, exact_gns):
    return exact_gns(mlp(), F.cross_entropy, *digits)[0]


def micro(**kwargs):
    return GradientNoiseScaleCallback(method="micro_batch", verbose=False, **kwargs)


def test_mlp_matches_exact_value(digits, mlp_exact, tmp_path):
    cb, trainer, _ = fit_with_gns(mlp(), *digits, callback=micro(report_path=str(tmp_path / "r.json")))
    assert_matches_exact(cb.estimate, mlp_exact)
    assert_matches_exact(cb.run_estimate, mlp_exact)
    assert cb.estimate.steps == 300 and cb.estimate.skipped_steps == 0 and cb.estimate.method == "micro_batch"
    # The report carries the same numbers.
    assert load_estimate(tmp_path / "r.json") == cb.estimate
    assert json.loads((tmp_path / "r.json").read_text())["run"]["accumulate_grad_batches"] == 4


def test_two_callbacks_on_one_trainer_each_measure_while_the_other_probes(digits, mlp_exact, tmp_path):
    """Each callback's probe runs trial batches through the model at the first batch. The other's hooks took them
    for part of a training step: its per-example norms saw a batch of 2 and stopped measuring."""
    first = GradientNoiseScaleCallback(probe=True, memory_budget_bytes=4_000_000, verbose=False,
                                       report_path=str(tmp_path / "a.json"))
    second = micro(probe=True, memory_budget_bytes=4_000_000, report_path=str(tmp_path / "b.json"))
    fit_with_gns(mlp(), *digits, callback=first, callbacks=[second], accumulate=2, batch_size=16)
    for cb in (first, second):
        assert cb.probe_result.measured and cb.run_estimate.steps == 300
        assert_matches_exact(cb.run_estimate, mlp_exact)


def test_cnn_with_groupnorm_matches_exact_value(digits, exact_gns):
    exact = exact_gns(small_cnn(), F.cross_entropy, *digits)[0]
    cb, _, _ = fit_with_gns(small_cnn(), *digits, callback=micro(), steps=250)
    assert_matches_exact(cb.run_estimate, exact)


def test_sum_reduced_loss(digits, mlp_exact):
    cb, _, _ = fit_with_gns(mlp(), *digits, callback=micro(loss_reduction="sum"), module_kwargs={"loss_reduction": "sum"})
    assert_matches_exact(cb.run_estimate, mlp_exact)


def test_partial_accumulation_windows_at_epoch_end(digits, mlp_exact):
    """Epochs of 10 micro-batches with accumulate=4: windows of 4, 4, 2 (Lightning divides the last by 4 too)."""
    x, y = digits
    loader = with_replacement_loader(x, y, 8, num_samples=80, seed=3)
    cb = micro()
    quiet_trainer(max_epochs=100, accumulate_grad_batches=4, callbacks=[cb]).fit(Classifier(mlp()), loader)
    assert cb.run_estimate.steps == 300
    assert_matches_exact(cb.run_estimate, mlp_exact)


def test_gradient_clipping_does_not_change_the_measurement(digits):
    plain, _, _ = fit_with_gns(mlp(), *digits, steps=60)
    clipped, _, _ = fit_with_gns(mlp(), *digits, steps=60, callback=micro(), gradient_clip_val=1e-3)
    assert clipped.run_estimate.b_simple == pytest.approx(plain.run_estimate.b_simple, rel=1e-6)


@pytest.mark.parametrize("method", ["micro_batch", "per_example"])
def test_fp16_with_a_real_grad_scaler_matches_fp32(digits, method):
    """Small-batch norms are taken on scaled gradients (scale 2^16 here): they must be unscaled."""
    make = lambda: GradientNoiseScaleCallback(method=method, verbose=False)  # noqa: E731
    fp32, _, _ = fit_with_gns(mlp(), *digits, steps=100, callback=make())
    scaler = torch.amp.GradScaler("cpu")
    fp16, trainer, _ = fit_with_gns(
        mlp(), *digits, steps=100, callback=make(), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    )
    assert trainer.precision_plugin.scaler.get_scale() > 1.0  # the scaler really scaled
    assert fp16.run_estimate.steps == 100 and fp16.run_estimate.method == method
    assert fp16.run_estimate.b_simple == pytest.approx(fp32.run_estimate.b_simple, rel=0.02)


def test_the_critical_batch_reads_the_loss_without_the_grad_scaler_s_scale(digits):
    """``on_before_backward`` gets the loss times the scale. Before, the critical batch read that: at a scale of
    2^16 it read "loss 1.5e+05", and where the scaler halves its scale (skipped steps, here from 2^40 down) the
    scaled loss fell as if training progressed. Now fp16 reads fp32's losses and critical batch."""
    make = lambda: GradientNoiseScaleCallback(method="per_example", verbose=False)  # noqa: E731
    fp32, _, _ = fit_with_gns(mlp(), *digits, accumulate=1, batch_size=32, steps=60, callback=make())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    fp16, trainer, _ = fit_with_gns(mlp(), *digits, accumulate=1, batch_size=32, steps=60, callback=make(),
                                    plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert trainer.precision_plugin.scaler.get_scale() < 2.0**40 and fp16.run_estimate.skipped_steps > 0
    ours, theirs = fp16.meter.critical_batch, fp32.meter.critical_batch
    assert ours.loss_start == pytest.approx(theirs.loss_start, rel=0.05)  # fp16 measures from the first unskipped step
    assert ours.loss_end == pytest.approx(theirs.loss_end, rel=0.05)
    assert ours.method.split(" (")[0] == theirs.method.split(" (")[0]  # "run average": the loss did not fall


def test_fp16_with_a_real_grad_scaler_matches_fp32_on_a_measured_subset(digits):
    """A token model at batch 64 measures 16 examples plus their summed gradient (and the unmeasured examples'
    block from each parameter's scaled gradient): unscaled like the norms, the estimate matches fp32."""
    from tests.helpers import token_model

    tokens = (digits[0] * 16).round().long()
    make = lambda: GradientNoiseScaleCallback(method="per_example", verbose=False)  # noqa: E731
    fp32, _, _ = fit_with_gns(token_model(), tokens, digits[1], accumulate=1, batch_size=64, steps=60,
                              callback=make())
    scaler = torch.amp.GradScaler("cpu")
    fp16, trainer, _ = fit_with_gns(token_model(), tokens, digits[1], accumulate=1, batch_size=64, steps=60,
                                    callback=make(), plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert trainer.precision_plugin.scaler.get_scale() > 1.0
    assert fp16.run_estimate.steps == fp32.run_estimate.steps > 50
    assert fp16.run_estimate.b_simple == pytest.approx(fp32.run_estimate.b_simple, rel=0.03)


def test_sketched_norms_under_fp16_with_a_real_grad_scaler_and_bf16_match_fp32(digits):
    """A 64-token model whose sequence layer is sketched (per_example/sketch.py): the probes are seeded per step, so
    the three runs draw the same ones, and the scaled (2^16) and bf16 gradients give the fp32 estimate."""
    from benchmarks.sketch_accuracy import PixelSequence
    from gns_callback.per_example.linear import sequence_norm_method

    assert sequence_norm_method(64, 64, 96) == "sketch"
    tokens = (digits[0] * 16).round().long()

    def fit(**precision):
        torch.manual_seed(0)
        callback = GradientNoiseScaleCallback(method="per_example", verbose=False, sharpness=False)
        return fit_with_gns(PixelSequence(), tokens, digits[1], accumulate=1, batch_size=32, steps=60,
                            callback=callback, **precision)

    fp32, _, _ = fit()
    fp16, trainer, _ = fit(plugins=[MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))])
    bf16, _, _ = fit(precision="bf16-mixed")
    assert trainer.precision_plugin.scaler.get_scale() > 1.0
    assert fp16.run_estimate.steps == bf16.run_estimate.steps == fp32.run_estimate.steps == 60
    assert fp16.run_estimate.b_simple == pytest.approx(fp32.run_estimate.b_simple, rel=0.01)
    assert bf16.run_estimate.b_simple == pytest.approx(fp32.run_estimate.b_simple, rel=0.05)


@pytest.mark.parametrize("method, accumulate", [("per_example", 1), ("micro_batch", 4)])
def test_float64_true_precision_matches_fp32(digits, method, accumulate):
    """``Trainer(precision="64-true")`` crashed the run at its first step (float64 gradients in a float32
    multi-tensor norm, tests/test_norms.py). The same stream in float64 reads what it reads in float32."""
    make = lambda: GradientNoiseScaleCallback(method=method, verbose=False)  # noqa: E731
    fp32, _, _ = fit_with_gns(mlp(), *digits, accumulate=accumulate, steps=60, callback=make())
    fp64, _, module = fit_with_gns(mlp(), *digits, accumulate=accumulate, steps=60, callback=make(),
                                   precision="64-true")
    assert next(module.parameters()).dtype == torch.float64
    assert fp64.run_estimate.steps == fp32.run_estimate.steps == 60
    assert fp64.run_estimate.b_simple == pytest.approx(fp32.run_estimate.b_simple, rel=1e-4)


def test_a_sparse_embedding_reads_what_a_dense_one_reads(digits):
    """``nn.Embedding(sparse=True)`` gives sparse ``.grad``: the step's ``|G_B|²`` crashed the run (a multi-tensor
    norm that can't read them, tests/test_norms.py). ``micro_batch`` measures it as the dense table."""
    from tests.helpers import token_model

    tokens = (digits[0] * 16).round().long()

    def run(sparse: bool):
        model = token_model()
        model.embed.sparse = sparse
        callback, _, _ = fit_with_gns(model, tokens, digits[1], steps=60, callback=micro())
        return callback.run_estimate

    sparse, dense = run(True), run(False)
    assert sparse.steps == dense.steps == 60
    assert sparse.b_simple == pytest.approx(dense.b_simple, rel=1e-5)


def test_bf16(digits):
    fp32, _, _ = fit_with_gns(mlp(), *digits, steps=100)
    bf16, _, _ = fit_with_gns(mlp(), *digits, steps=100, callback=micro(), precision="bf16-mixed")
    assert bf16.run_estimate.b_simple == pytest.approx(fp32.run_estimate.b_simple, rel=0.05)


class InfOnceClassifier(Classifier):
    """Returns an infinite loss on one micro-batch: the GradScaler skips that optimizer step."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if batch_idx == 21 else loss


def test_non_finite_step_is_skipped_and_counted(digits, mlp_exact):
    x, y = digits
    cb = micro()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    loader = with_replacement_loader(x, y, 8, 4 * 8 * 300, seed=1)
    quiet_trainer(accumulate_grad_batches=4, callbacks=[cb], plugins=[plugin]).fit(InfOnceClassifier(mlp()), loader)
    assert cb.run_estimate.steps == 299 and cb.run_estimate.skipped_steps == 1
    assert math.isfinite(cb.run_estimate.b_simple)
    assert_matches_exact(cb.run_estimate, mlp_exact)


class WithUnusedLayer(torch.nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net, self.unused = net, torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)


def test_frozen_and_unused_parameters(digits, exact_gns):
    """A frozen layer and a parameter that never gets a gradient are left out of both norms consistently."""
    x, y = digits
    net = mlp()
    net[0].bias.requires_grad_(False)
    exact = exact_gns(net, F.cross_entropy, x, y)[0]
    cb, _, _ = fit_with_gns(WithUnusedLayer(net), x, y, callback=micro())
    assert_matches_exact(cb.run_estimate, exact)


def test_accumulation_schedule_measures_only_steps_with_several_micro_batches(digits):
    x, y = digits
    loader = with_replacement_loader(x, y, 8, num_samples=8 * 40, seed=0)  # 40 micro-batches per epoch
    cb = micro()
    schedule = GradientAccumulationScheduler({0: 1, 1: 4})
    quiet_trainer(max_epochs=2, callbacks=[cb, schedule]).fit(Classifier(mlp()), loader)
    assert cb.run_estimate.steps == 10 and cb.run_estimate.skipped_steps == 40


def test_training_is_unchanged_by_the_callback(digits):
    """Real training (Adam, lr=1e-2): identical weights with and without the callback."""
    x, y = digits
    results = []
    for callbacks in ([], [micro()]):
        torch.manual_seed(0)
        module = Classifier(mlp(), lr=1e-2, optimizer="adam")
        loader = with_replacement_loader(x, y, 16, 16 * 2 * 30, seed=5)
        quiet_trainer(accumulate_grad_batches=2, callbacks=callbacks).fit(module, loader)
        results.append({k: v.clone() for k, v in module.state_dict().items()})
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key]), key


def test_hooks_are_removed_after_fit(digits):
    _, _, module = fit_with_gns(mlp(), *digits, steps=5)
    assert all(not p._backward_hooks for p in module.parameters())


class RecordingLogger(Logger):
    def __init__(self):
        super().__init__()
        self.history = []

    name, version = "recording", 0

    def log_metrics(self, metrics, step=None):
        self.history.append(dict(metrics))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def test_metrics_reach_loggers_and_callback_metrics(digits):
    logger = RecordingLogger()
    cb, trainer, _ = fit_with_gns(mlp(), *digits, steps=100, callback=micro(log_every_n_steps=10), logger=logger,
                                  log_every_n_steps=10, default_root_dir=None)
    names = ["gns/b_simple", "gns/grad_sq_norm", "gns/trace_sigma", "gns/b_simple_ci_low", "gns/b_simple_ci_high"]
    for name in names:
        assert name in trainer.callback_metrics
        assert any(name in m for m in logger.history)
    assert trainer.callback_metrics["gns/b_simple"].item() == pytest.approx(cb.estimate.b_simple, rel=1e-5)
    assert trainer.callback_metrics["gns/b_simple_ci_high"].item() == pytest.approx(cb.estimate.ci_high, rel=1e-5)
    assert [h["step"] for h in cb.history] == list(range(10, 101, 10))
    assert cb.history[-1]["b_simple"] == pytest.approx(cb.estimate.b_simple)


def test_default_report_path_is_under_the_log_dir(digits, tmp_path):
    cb, trainer, _ = fit_with_gns(mlp(), *digits, steps=5, callback=micro(), default_root_dir=str(tmp_path))
    assert cb.report_path is None and cb.report_file == str(tmp_path / "gns_report.json")
    assert load_estimate(cb.report_file).steps == 5


def test_checkpoint_resume_restores_the_running_state_exactly(digits, tmp_path):
    x, y = digits
    loader = with_replacement_loader(x, y, 8, 8 * 2 * 200, seed=0)
    first = micro()
    trainer = quiet_trainer(max_steps=30, accumulate_grad_batches=2, callbacks=[first])
    trainer.fit(Classifier(mlp()), loader)
    path = tmp_path / "gns.ckpt"
    trainer.save_checkpoint(path)
    torch.load(path, weights_only=True)  # plain types only: loads under weights_only=True

    resumed = micro()  # resume with no further steps: the state is exactly the saved one
    quiet_trainer(max_steps=30, accumulate_grad_batches=2, callbacks=[resumed]).fit(Classifier(mlp()), loader, ckpt_path=path)
    assert resumed.state_dict() == first.state_dict()

    continued = micro()
    quiet_trainer(max_steps=50, max_epochs=10, accumulate_grad_batches=2, callbacks=[continued]).fit(Classifier(mlp()), loader, ckpt_path=path)
    assert continued.run_estimate.steps == 50


def test_resume_with_other_arguments_says_the_estimate_restarts(digits, tmp_path):
    """Lightning skips state saved under another state_key (method=, ema_decay=): the user is told, with the fix."""
    x, y = digits
    loader = with_replacement_loader(x, y, 8, 8 * 2 * 200, seed=0)
    trainer = quiet_trainer(max_steps=10, accumulate_grad_batches=2, callbacks=[micro()])
    trainer.fit(Classifier(mlp()), loader)
    path = tmp_path / "gns.ckpt"
    trainer.save_checkpoint(path)

    resumed = GradientNoiseScaleCallback(method="micro_batch", ema_decay=0.9, verbose=False)
    with pytest.warns(UserWarning, match=r"10 measured steps\) were measured with \{'method': 'micro_batch', "
                                         r"'ema_decay': 0.99\}.*restarts from this step.*checkpoint's arguments"):
        quiet_trainer(max_steps=15, max_epochs=10, accumulate_grad_batches=2, callbacks=[resumed]).fit(
            Classifier(mlp()), loader, ckpt_path=path)
    assert resumed.run_estimate.steps == 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ema_decay": 1.5}, "ema_decay"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"method": "magic"}, "method"),
        ({"confidence": 95}, "confidence"),
        ({"loss_reduction": "avg"}, "loss_reduction"),
        ({"log_every_n_steps": 0}, "log_every_n_steps"),
        ({"measure_every_n_steps": 0}, "measure_every_n_steps"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradientNoiseScaleCallback(**kwargs)


def test_micro_batch_without_accumulation_says_what_to_do(digits):
    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches"):
        fit_with_gns(mlp(), *digits, accumulate=1, steps=3)


class ManualClassifier(Classifier):
    def __init__(self, net):
        super().__init__(net)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_is_refused_clearly(digits):
    x, y = digits
    with pytest.raises(MisconfigurationException, match="automatic optimization"):
        quiet_trainer(callbacks=[micro()], max_steps=2).fit(ManualClassifier(mlp()), with_replacement_loader(x, y, 8, 64))


def test_each_optimizer_step_hands_the_meter_what_lightning_knows(digits, monkeypatch):
    """Wiring: one meter.step per optimizer step, with the micro-batch sizes, the loss divisor (accumulate) and the
    GradScaler's scale."""
    from gns_callback.meter import GradientNoiseScaleMeter

    calls = []
    real_step = GradientNoiseScaleMeter.step

    def spy(self, micro_batch_size=None, loss_scale=None, loss_divisor=None, loss=None):
        calls.append((list(micro_batch_size), None if loss_scale is None else float(loss_scale), loss_divisor))
        assert loss is not None and loss.ndim == 0  # the step's mean training loss, for the critical batch
        return real_step(self, micro_batch_size, loss_scale, loss_divisor, loss)

    monkeypatch.setattr(GradientNoiseScaleMeter, "step", spy)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    cb, trainer, _ = fit_with_gns(mlp(), *digits, steps=10, callback=micro(),
                                  plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    assert calls == [([8, 8, 8, 8], 2.0**12, 4)] * 10
    assert cb.meter.method == "micro_batch" and cb.run_estimate.steps == 10


def test_measuring_one_step_in_n_during_a_fit(digits, mlp_exact):
    """``measure_every_n_steps=2``: 150 of 300 steps measured, the exact value inside the interval."""
    cb, _, _ = fit_with_gns(mlp(), *digits, callback=micro(measure_every_n_steps=2))
    assert cb.run_estimate.steps == 150 and cb.run_estimate.skipped_steps == 0
    assert_matches_exact(cb.run_estimate, mlp_exact)


def test_measuring_one_step_in_n_leaves_training_unchanged_and_resumes_in_phase(digits, tmp_path):
    """Real training (Adam): identical weights with and without the callback at ``measure_every_n_steps=3``; a
    checkpoint at step 31 resumes the duty cycle in phase (steps 0, 3, ..., 48 measured: 17 of 50)."""
    x, y = digits
    weights = []
    for callbacks in ([], [micro(measure_every_n_steps=3)]):
        torch.manual_seed(0)
        loader = with_replacement_loader(x, y, 8, 8 * 2 * 200, seed=0)
        module = Classifier(mlp(), lr=1e-2, optimizer="adam")
        trainer = quiet_trainer(max_steps=31, accumulate_grad_batches=2, callbacks=callbacks)
        trainer.fit(module, loader)
        weights.append(module.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    path = tmp_path / "gns.ckpt"
    trainer.save_checkpoint(path)
    continued = micro(measure_every_n_steps=3)
    quiet_trainer(max_steps=50, max_epochs=10, accumulate_grad_batches=2, callbacks=[continued]).fit(
        Classifier(mlp(), lr=1e-2, optimizer="adam"), loader, ckpt_path=path)
    assert continued.run_estimate.steps == 17 and continued.meter.steps_offered == 50


class FailsAtStep(Classifier):
    """An error in the user's training_step at optimizer step ``at`` (or Ctrl-C there)."""

    def __init__(self, net, at: int, error: BaseException) -> None:
        super().__init__(net)
        self.at, self.error = at, error

    def training_step(self, batch, batch_idx):
        if self.global_step == self.at:
            raise self.error
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("error", [RuntimeError("the user's bug"), KeyboardInterrupt()])
def test_an_interrupted_fit_writes_the_report_of_its_measured_steps(digits, exact_gns, tmp_path, error):
    """Before, a fit stopped by an error or Ctrl-C wrote no report: 60 measured steps were lost, and
    ``python -m gns_callback report`` found nothing. Now rank zero writes them, with ``run.interrupted``."""
    from gns_callback.report_cli import main

    x, y = digits
    report = tmp_path / "report.json"
    gns = GradientNoiseScaleCallback(method="per_example", report_path=str(report), verbose=False)
    trainer = quiet_trainer(callbacks=[gns])
    loader = with_replacement_loader(x, y, 32, 32 * 200, seed=0)
    with pytest.raises((RuntimeError, SystemExit)):  # Lightning exits on Ctrl-C after shutting down
        trainer.fit(FailsAtStep(mlp(), at=60, error=error), loader)
    sections = json.loads(report.read_text())
    assert sections["run"]["interrupted"] == {RuntimeError: "RuntimeError: the user's bug",
                                              KeyboardInterrupt: "KeyboardInterrupt"}[type(error)]
    assert sections["run"]["global_step"] == 60
    estimate = load_estimate(report, "run_estimate")
    assert estimate.steps == 60 and estimate.ci_low <= exact_gns(mlp(), F.cross_entropy, x, y)[0] <= estimate.ci_high
    assert main([str(report), "--out", str(tmp_path / "pictures")]) == 0
    # What fit end adds, from the measured steps (before, neither: the command drew no history and printed no table).
    assert sections["history"][-1] == {**sections["history"][-1], "step": 60, "final": True}
    assert sections["recommendation"] == gns.recommendation.to_dict() and gns.recommendation.estimate_steps == 60
    assert (tmp_path / "pictures" / "gns_history.png").exists()
