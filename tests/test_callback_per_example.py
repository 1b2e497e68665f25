"""method="per_example" end to end against the exact B_simple (MLP, CNN with GroupNorm, token model)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import pytorch_lightning as pl
from pytorch_lightning.utilities.exceptions import MisconfigurationException

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import assert_matches_exact, bn_mlp, fit_with_gns, mlp, small_cnn, token_model


def per_example(**kwargs):
    return GradientNoiseScaleCallback(method="per_example", verbose=False, **kwargs)


@pytest.fixture(scope="module")
def digit_tokens(digits):
    """The digits as sequences of 64 tokens (pixel intensities 0..16)."""
    x, y = digits
    return (x * 16).round().long(), y


@pytest.mark.parametrize("accumulate, batch_size", [(1, 32), (3, 16)])
def test_mlp(digits, exact_gns, accumulate, batch_size):
    exact = exact_gns(mlp(), F.cross_entropy, *digits)[0]
    cb, _, _ = fit_with_gns(mlp(), *digits, accumulate=accumulate, batch_size=batch_size, steps=150, seed=0, callback=per_example())
    assert cb.run_estimate.method == "per_example"
    assert_matches_exact(cb.run_estimate, exact)


def test_cnn_with_groupnorm(digits, exact_gns):
    exact = exact_gns(small_cnn(), F.cross_entropy, *digits)[0]
    cb, _, _ = fit_with_gns(small_cnn(), *digits, accumulate=1, batch_size=32, steps=150, seed=0, callback=per_example())
    assert_matches_exact(cb.run_estimate, exact)


def test_token_model_with_embedding_and_layernorm(digit_tokens, exact_gns, tmp_path):
    exact = exact_gns(token_model(), F.cross_entropy, *digit_tokens)[0]
    cb, _, _ = fit_with_gns(token_model(), *digit_tokens, accumulate=1, batch_size=64, steps=300, seed=0,
                            callback=per_example(report_path=str(tmp_path / "r.json")))
    assert cb.coverage["fraction"] == 1.0
    assert_matches_exact(cb.run_estimate, exact)


def test_unbiased_and_calibrated_across_seeds(digits, exact_gns):
    """Ten independent runs: mean |G|² and tr(Σ) within 3 standard errors of the exact values, and at least
    8 of 10 intervals cover the exact B_simple (P(≤ 7 of 10) = 1.2% for a calibrated 95% interval)."""
    b_exact, g_exact, t_exact = exact_gns(mlp(), F.cross_entropy, *digits)
    grad_sq, trace, covered = [], [], 0
    for seed in range(10):
        cb, _, _ = fit_with_gns(mlp(), *digits, accumulate=1, batch_size=32, steps=80, seed=100 + seed, callback=per_example())
        est = cb.run_estimate
        grad_sq.append(est.grad_sq_norm)
        trace.append(est.trace_sigma)
        covered += est.ci_low <= b_exact <= est.ci_high
    for values, exact in ((grad_sq, g_exact), (trace, t_exact)):
        se = np.std(values, ddof=1) / np.sqrt(len(values))
        assert abs(np.mean(values) - exact) < 3 * se, (np.mean(values), exact, se)
    assert covered >= 8


def test_per_example_and_micro_batch_agree_on_the_same_run(digits):
    cb_pe, _, _ = fit_with_gns(mlp(), *digits, accumulate=4, batch_size=8, steps=200, seed=0, callback=per_example())
    cb_mb, _, _ = fit_with_gns(mlp(), *digits, accumulate=4, batch_size=8, steps=200, seed=0,
                               callback=GradientNoiseScaleCallback(method="micro_batch", verbose=False))
    pe, mb = cb_pe.run_estimate, cb_mb.run_estimate
    assert pe.ci_low <= mb.b_simple <= pe.ci_high and mb.ci_low <= pe.b_simple <= mb.ci_high
    # Per-example norms use every example as a small batch: a tighter interval from the same data.
    assert pe.ci_high - pe.ci_low < mb.ci_high - mb.ci_low


def test_auto_prefers_per_example_and_falls_back_for_batchnorm(digits):
    auto = GradientNoiseScaleCallback(verbose=False)
    fit_with_gns(mlp(), *digits, accumulate=1, steps=5, callback=auto)
    assert auto.resolved_method == "per_example"
    auto_bn = GradientNoiseScaleCallback(verbose=False)
    fit_with_gns(bn_mlp(), *digits, accumulate=2, steps=5, callback=auto_bn)
    assert auto_bn.resolved_method == "micro_batch"
    with pytest.raises(MisconfigurationException, match="BatchNorm"):
        fit_with_gns(bn_mlp(), *digits, accumulate=1, steps=5, callback=GradientNoiseScaleCallback(verbose=False))


class ReleaseBatchNorm(pl.Callback):
    """Holds the model's BatchNorm layers in eval mode for the first ``steps`` optimizer steps, then trains them."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_start(self, trainer, pl_module):
        self.on_train_batch_start(trainer, pl_module, None, 0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        for module in pl_module.modules():
            if isinstance(module, torch.nn.BatchNorm1d):
                module.train(trainer.global_step >= self.steps)


def test_batchnorm_released_mid_run_switches_auto_to_micro_batch(digits):
    """BatchNorm in eval mode at fit start is measured per example; once released into training mode its batch
    statistics couple the examples. Before, the rest of the run was measured per example with no word; now ``auto``
    switches to ``micro_batch`` at that step (here 2 micro-batches per step) and warns once."""
    cb = GradientNoiseScaleCallback(verbose=False)
    with pytest.warns(UserWarning, match="switched from method='per_example' to 'micro_batch'.*BatchNorm layer went"):
        fit_with_gns(bn_mlp(), *digits, accumulate=2, steps=20, callback=cb, callbacks=[ReleaseBatchNorm(5)])
    assert cb.meter.switched_from == "per_example" and cb.run_estimate.method == "micro_batch"
    assert cb.run_estimate.steps > 0


def test_explicit_per_example_on_batchnorm_is_refused_at_fit_start(digits):
    """BatchNorm couples the examples: per-example norms would be a confidently wrong number, so no step runs."""
    with pytest.raises(MisconfigurationException, match="BatchNorm.*micro_batch"):
        fit_with_gns(bn_mlp(), *digits, accumulate=1, steps=5, callback=per_example())


class TiedModel(torch.nn.Module):
    """Input and output projections share one weight (tied)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(64, 10, bias=False)
        self.hidden = torch.nn.Linear(10, 10)
        self.out = torch.nn.Linear(10, 64, bias=False)
        self.out.weight = self.inp.weight  # (10, 64) used as (64 → 10) and, transposed, as (10 → 64)

    def forward(self, x):
        h = torch.tanh(self.hidden(self.inp(x)))
        return F.linear(h, self.inp.weight.t())[:, :10]


def test_tied_weights_are_excluded_and_reported(digits, tmp_path):
    cb = per_example(report_path=str(tmp_path / "r.json"))
    fit_with_gns(TiedModel(), *digits, accumulate=1, steps=20, callback=cb)
    coverage = cb.coverage
    assert 0 < coverage["fraction"] < 1
    assert any("inp.weight" in name or "out.weight" in name for name in coverage["excluded"])
    assert cb.run_estimate.steps == 20


def test_hooks_removed_after_fit(digits):
    _, _, module = fit_with_gns(token_model(), *(digits[0].mul(16).round().long(), digits[1]), accumulate=1, steps=3,
                                callback=per_example())
    for m in module.modules():
        assert not m._forward_hooks
