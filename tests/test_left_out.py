"""The parameters left out of the per-example norms (:mod:`gns_callback.left_out`): the whole model's exact B_simple
lies between the bounds for every split of their gradient into signal and noise, the bounds are reached at the
two extremes, and a meter whose estimate is the whole model's makes room for them in its intervals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.left_out_coverage import BATCH, measured
from gns_callback.estimate import GNSEstimate
from gns_callback.exact import exact_noise_scale, per_example_gradients
from gns_callback.left_out import LeftOutShare, whole_model_interval
from gns_callback.per_example import PerExampleNormTracker
from gns_callback.smoothing import summarize_ratio
from tests.helpers import LearnedSlope
from tests.trust.models import ScaledLogits



def parts(g: torch.Tensor, covered: torch.Tensor) -> tuple[float, float, float]:
    """``(B_c, B_whole, r)`` of per-example gradients ``g`` (N, P) with ``covered`` (P,) the measured columns, for
    batches of :data:`BATCH` drawn with replacement."""
    b_c, grad_c, trace_c = exact_noise_scale(g[:, covered])
    b_whole = exact_noise_scale(g)[0]
    _, grad_u, trace_u = exact_noise_scale(g[:, ~covered])
    r = (grad_u + trace_u / BATCH) / (grad_c + trace_c / BATCH)  # E|g_B,u|² against E|g_B,c|²
    return b_c, b_whole, r


def covered_columns(net: nn.Module) -> torch.Tensor:
    measured = {id(p) for p in PerExampleNormTracker(net).covered_parameters()}
    return torch.cat([torch.full((p.numel(),), id(p) in measured) for p in net.parameters() if p.requires_grad])


def prelu_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), LearnedSlope(), nn.Linear(32, 10))


@pytest.mark.parametrize("build", [lambda: ScaledLogits(0.05), lambda: ScaledLogits(0.2), lambda: ScaledLogits(1.0),
                                   prelu_mlp], ids=["scale 0.05", "scale 0.2", "scale 1", "a bare PReLU slope"])
def test_the_whole_models_exact_value_lies_between_the_bounds(digits, build):
    model = build()
    covered = covered_columns(model)
    assert 0 < (~covered).sum() < 40  # a temperature or a PReLU slope left out
    b_c, b_whole, r = parts(per_example_gradients(model, F.cross_entropy, *digits), covered)
    low, high = whole_model_interval(b_c, b_c, r, BATCH)
    assert low <= b_whole <= high
    assert (low, high) != (b_c, b_c)


def test_the_bounds_are_reached_where_the_left_out_gradient_is_all_signal_or_all_noise():
    torch.manual_seed(0)
    covered = torch.arange(30) < 20
    g = torch.randn(400, 30, dtype=torch.float64) + 0.3
    signal = g.clone()
    signal[:, 20:] = 0.3  # every example the same: no noise in the left-out part
    noise = g.clone()
    noise[:, 20:] -= noise[:, 20:].mean(0)  # mean zero: no signal in it
    for grads, end in ((signal, 0), (noise, 1)):
        b_c, b_whole, r = parts(grads, covered)
        assert whole_model_interval(b_c, b_c, r, BATCH)[end] == pytest.approx(b_whole, rel=1e-9)


def test_without_replacement_the_noise_end_grows_by_the_finite_population_factor():
    phi = (100 - BATCH) / (100 - 1)
    low, high = whole_model_interval(50.0, 60.0, 0.1, BATCH, phi)
    assert high == pytest.approx(60.0 + 0.1 * (BATCH / phi + 60.0))
    assert low == pytest.approx(50.0 / (1 + 0.1 * (1 + phi * 50.0 / BATCH)))
    assert whole_model_interval(50.0, math.inf, 0.1, BATCH) == (pytest.approx(50 / (1 + 0.1 * (1 + 50 / BATCH))),
                                                                 math.inf)
    assert whole_model_interval(50.0, 60.0, 0.0, BATCH) == (50.0, 60.0)


def estimate(averaging: str = "run") -> GNSEstimate:
    return GNSEstimate(b_simple=55.0, grad_sq_norm=1.0, trace_sigma=55.0, ci_low=50.0, ci_high=60.0, confidence=0.95,
                       steps=10, skipped_steps=0, effective_steps=10.0, method="per_example", averaging=averaging)


def test_the_share_is_a_ratio_of_sums_over_valid_steps_and_survives_a_checkpoint():
    share = LeftOutShare(ema_decay=0.5)
    assert share.widened(estimate()) == estimate()  # nothing left out: the same estimate
    share.update(1.0, 10.0, 32, valid=True)
    share.update(3.0, 10.0, 32, valid=True)
    share.update(100.0, 10.0, 32, valid=False)  # a step the estimates skip adds nothing here either
    share.update(math.nan, 10.0, 32, valid=True)
    assert share.share() == pytest.approx(4.0 / 20.0)
    assert share.share(recent=True) == pytest.approx((0.5 * 1.0 + 3.0) / (0.5 * 10.0 + 10.0))
    resumed = LeftOutShare(ema_decay=0.5)
    resumed.load_state_dict(share.state_dict())
    assert resumed.widened(estimate("ema")) == share.widened(estimate("ema"))
    low, high = whole_model_interval(50.0, 60.0, 0.2, 32)
    assert (share.widened(estimate()).ci_low, share.widened(estimate()).ci_high) == (low, high)


def test_a_meter_makes_room_for_a_temperature_left_out(digits):
    """Before, the run average read 82 [73, 95] here, for the other parameters, against the whole model's 171."""
    model = ScaledLogits(0.05)
    exact = exact_noise_scale(per_example_gradients(model, F.cross_entropy, *digits))[0]
    meter = measured(model, *digits, seed=0, steps=300)
    assert meter.coverage["fraction"] > 0.999 and meter.coverage["left_out_gradient_share"] > 0
    for est in meter.read():
        assert est.ci_low <= exact <= est.ci_high, (est, exact)


def test_nothing_left_out_leaves_the_intervals_as_they_were(digits):
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    meter = measured(model, *digits, seed=0, steps=50)
    assert meter.coverage["left_out_gradient_share"] == 0.0
    as_summed = summarize_ratio(meter.run.sums.tolist(), meter.confidence)
    assert (meter.run_estimate.ci_low, meter.run_estimate.ci_high) == (as_summed.ci_low, as_summed.ci_high)


class MostlyBilinear(nn.Module):
    """An ``nn.Bilinear`` (not measured per example) holding most of the parameters, under a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.pair, self.head = nn.Bilinear(64, 64, 8), nn.Linear(8, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.pair(x, x)))


def test_below_min_coverage_the_share_is_not_read(digits):
    """The estimate is then the covered parameters' own: the share reads None, not a 0.0 that says nothing is
    left out (before, the report said 0.0 where the left-out weight carried about 20% of the gradient)."""
    meter = measured(MostlyBilinear(), *digits, seed=0, steps=5)
    assert meter.coverage["fraction"] < 0.1 and meter.coverage["left_out_gradient_share"] is None
