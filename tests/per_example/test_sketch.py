"""The random-probe sketch of per-example squared norms: unbiased against the exact norms, with the variance the
formula states, independent across examples, on its own random stream; and the meter that uses it still holds the
exact noise scale of a real data set in its interval."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.sketch_accuracy import PixelSequence, stream_estimates, train
from gns_callback.exact import exact_noise_scale, per_example_gradients
from gns_callback.per_example import launches, linear, sketch
from gns_callback.per_example.conv import conv_sq_norms, per_example_weight_grads
from gns_callback.per_example.launches import ACCELERATOR_LAUNCH_COST
from gns_callback.per_example.linear import sequence_norm_method
from gns_callback import GradientNoiseScaleMeter
from gns_callback.per_example.sketch import PROBES, probe_signs, reseed_probes, sketched_sq_norms

DRAWS = 3000


@pytest.fixture(autouse=True)
def fresh_probe_streams():
    """Every test starts the sketch's generators from their seed, whatever ran before."""
    sketch._generators.clear()
    reseed_probes(0)
    yield
    sketch._generators.clear()


def _rademacher_variance(c: torch.Tensor) -> torch.Tensor:
    """Variance of one probe's ``|Cᵀs|²`` per example for ``C`` (N, n, m) probed on its ``n`` side:
    ``2·(|M|²_F − Σ_i M_ii²)`` with ``M = C·Cᵀ`` (Avron & Toledo 2011)."""
    m = c @ c.transpose(1, 2)
    return 2.0 * (m.square().sum(dim=(1, 2)) - torch.diagonal(m, dim1=1, dim2=2).square().sum(dim=1))


def test_the_sequence_sketch_is_unbiased_with_the_stated_variance():
    torch.manual_seed(0)
    a, d = torch.randn(3, 40, 12, dtype=torch.float64), torch.randn(3, 40, 20, dtype=torch.float64)
    a[2] = a[2, :1]  # every position the same input: a rank-one example, the sketch's worst case
    c = a.transpose(1, 2) @ d  # (N, 12, 20): each example's gradient, probed on its narrower side
    exact = c.square().sum(dim=(1, 2))
    draws = torch.stack([sketched_sq_norms(a, d) for _ in range(DRAWS)])
    variance = _rademacher_variance(c) / PROBES
    assert torch.all((draws.mean(0) - exact).abs() < 4 * (variance / DRAWS).sqrt())
    assert torch.allclose(draws.var(0), variance, rtol=0.15)
    assert variance[2] / exact[2] ** 2 > variance[0] / exact[0] ** 2  # a rank-one example is the noisiest


def test_a_wide_side_larger_than_the_narrow_one_is_probed_on_the_narrow_side():
    torch.manual_seed(1)
    a, d = torch.randn(2, 30, 24, dtype=torch.float64), torch.randn(2, 30, 8, dtype=torch.float64)
    exact = (a.transpose(1, 2) @ d).square().sum(dim=(1, 2))
    draws = torch.stack([sketched_sq_norms(a, d) for _ in range(DRAWS)])
    variance = _rademacher_variance(d.transpose(1, 2) @ a) / PROBES
    assert torch.all((draws.mean(0) - exact).abs() < 4 * (variance / DRAWS).sqrt())


@pytest.mark.parametrize("conv, size", [(nn.Conv2d(16, 48, 3, padding=1), (20, 20)),
                                        (nn.Conv2d(32, 48, 3, stride=2, groups=2), (40, 40)),
                                        (nn.Conv1d(16, 48, 5), (200,)),
                                        (nn.Conv1d(4, 64, 9), (400,)),
                                        (nn.Conv3d(16, 48, 3, padding=1), (8, 8, 8))])  # few input channels: im2col, then sketched
def test_the_convolution_sketch_is_unbiased(conv, size):
    torch.manual_seed(2)
    conv = conv.double()
    x = torch.randn(3, conv.in_channels, *size, dtype=torch.float64)
    grad = torch.randn_like(conv(x))
    positions = grad[0, 0].numel()
    out = conv.out_channels
    assert sequence_norm_method(positions, conv.weight[0].numel(), out // conv.groups) == "sketch"
    weight = per_example_weight_grads(conv, x, grad).reshape(3, -1).square().sum(1)
    exact = weight + grad.reshape(3, out, -1).sum(-1).square().sum(1)
    draws = torch.stack([conv_sq_norms(conv, x, grad) for _ in range(DRAWS // 3)])
    standard_error = draws.std(0) / math.sqrt(draws.shape[0])
    assert torch.all((draws.mean(0) - exact).abs() < 4 * standard_error)
    assert torch.all(draws.std(0) / exact < 0.25)


def test_probes_are_independent_across_examples():
    """The same gradient twice in a batch: its two sketches' errors are uncorrelated, so they average out over a
    batch instead of moving together."""
    torch.manual_seed(3)
    a, d = torch.randn(1, 40, 16, dtype=torch.float64), torch.randn(1, 40, 16, dtype=torch.float64)
    a, d = a.expand(2, -1, -1).contiguous(), d.expand(2, -1, -1).contiguous()
    draws = torch.stack([sketched_sq_norms(a, d) for _ in range(DRAWS)]).numpy()
    assert abs(np.corrcoef(draws.T)[0, 1]) < 4 / math.sqrt(DRAWS)


def test_the_probes_leave_the_users_random_streams_alone():
    state = torch.get_rng_state()
    signs = probe_signs((4, 16, PROBES), torch.device("cpu"), torch.float32)
    assert torch.equal(torch.get_rng_state(), state)
    assert set(signs.unique().tolist()) == {-1.0, 1.0}
    assert abs(probe_signs((64, 64, PROBES), torch.device("cpu"), torch.float64).mean().item()) < 0.03


def test_short_or_narrow_sequences_stay_exact():
    assert sequence_norm_method(8, 16, 16) == "gram"
    assert sequence_norm_method(64, 16, 32) == "materialise"
    assert sequence_norm_method(64, 128, 512) == "sketch"


def test_on_an_accelerator_a_sketch_pays_for_its_extra_launches():
    """benchmarks/gpu_conv_paths.py on an H200: the CNN's 32→64 stride-2 convolution at batch 64 took 0.35 ms
    sketched against 0.15 ms exact, its cost all launches. Per call the launches are shared by the examples: a
    layer whose exact norms cost billions of multiply-adds per call is still sketched."""
    share = ACCELERATOR_LAUNCH_COST / 64
    assert sequence_norm_method(256, 32 * 9, 64) == "sketch"  # the CPU: arithmetic alone
    assert sequence_norm_method(256, 32 * 9, 64, launch_share=share) == "materialise"
    assert sequence_norm_method(64, 128, 512, launch_share=ACCELERATOR_LAUNCH_COST / 32) == "gram"
    assert sequence_norm_method(196, 256 * 9, 256, launch_share=ACCELERATOR_LAUNCH_COST / 256) == "sketch"


def test_on_an_accelerator_the_cnn_layers_norms_are_exact(monkeypatch, reference_sq_norms):
    """The norms themselves ask the device: with its tensors' device taken for an accelerator, a convolution and a
    sequence the CPU sketches give the exact norms (a sketch would be off by its noise)."""
    monkeypatch.setattr(launches, "launch_cost", lambda device: ACCELERATOR_LAUNCH_COST)
    layer = nn.Conv2d(32, 64, 3, stride=2, padding=1)
    x = torch.randn(8, 32, 32, 32)
    grad = torch.randn_like(layer(x))
    assert sequence_norm_method(256, 32 * 9, 64) == "sketch"
    torch.testing.assert_close(conv_sq_norms(layer, x, grad), reference_sq_norms(layer, x, grad).float(), rtol=1e-4,
                               atol=0)
    a, d = torch.randn(4, 64, 128), torch.randn(4, 64, 512)
    exact = torch.einsum("ntk,ntl->nkl", a, d).square().sum(dim=(1, 2))
    torch.testing.assert_close(linear.sequence_sq_norms(a, d), exact, rtol=1e-4, atol=0)


def test_a_sketched_meter_holds_the_exact_noise_scale_of_real_data(digits):
    """Fixed parameters after 150 SGD steps (exact ``B_simple`` by brute force over all 1797 examples: 54 with one
    thread, about twice the batch of 32), 8 streams of 100 batches: the meter, whose sequence layer is sketched,
    holds the exact value in its interval on at least 7 streams (nominal 7.6), and its mean error is that of a
    ratio of 100 steps' means, about 0.1 here. (Against the same meter with exact norms on many streams:
    benchmarks/sketch_accuracy.py.)"""
    x, y = digits
    tokens = (x * 16).round().long()
    torch.manual_seed(0)
    model = PixelSequence()
    train(model, tokens, y, steps=150)
    assert sequence_norm_method(64, 64, 96) == "sketch"
    exact = exact_noise_scale(per_example_gradients(model, F.cross_entropy, tokens, y))[0]
    estimates = stream_estimates(model, tokens, y, streams=8, steps=100)
    assert sum(e.ci_low <= exact <= e.ci_high for e in estimates) >= 7
    assert np.mean([abs(e.b_simple / exact - 1) for e in estimates]) < 0.2


def test_a_resumed_meter_draws_the_probes_an_uninterrupted_one_would(digits):
    """The probes are seeded by the optimizer step, which the checkpoint keeps: saved after 30 steps and resumed in
    a fresh meter, the sketched estimate after 60 is bit for bit the uninterrupted one's, though another meter ran
    in between."""
    x, y = digits
    tokens = (x * 16).round().long()
    torch.manual_seed(0)
    model = PixelSequence()

    def run(meter: GradientNoiseScaleMeter, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(30):
            index = torch.randint(0, x.shape[0], (32,), generator=generator)
            model.zero_grad()
            F.cross_entropy(model(tokens[index]), y[index]).backward()
            meter.step()

    with GradientNoiseScaleMeter(model) as whole:
        run(whole, 0)
        run(whole, 1)
    with GradientNoiseScaleMeter(model) as first:
        run(first, 0)
    state = first.state_dict()
    with GradientNoiseScaleMeter(model) as other:
        run(other, 2)
    with GradientNoiseScaleMeter(model) as resumed:
        resumed.load_state_dict(state)
        run(resumed, 1)
    assert resumed.run_estimate == whole.run_estimate and resumed.estimate == whole.estimate
