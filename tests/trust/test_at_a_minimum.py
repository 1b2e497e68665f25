"""At a minimum ``|G|²`` is zero and the noise scale unbounded: no estimate may read a finite number with an interval
that shuts the true value out.

A least-squares regression on scikit-learn's diabetes data set, set to its solution (exact ``B_simple`` = tr Σ/|G|²
≈ 2.6e16, ``|G|²`` ≈ 7e-16). The recent estimate's trend kernel then weighs noise of either sign, and its weights
can sum below zero: the recent value read ``B_simple = 0`` (95% CI 0–inf, ``|G|²`` = −0.93) on one seed in five,
a point at the wrong end of the scale.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_diabetes
from torch import nn

from gns_callback import GradientNoiseScaleMeter
from gns_callback.exact import exact_b_simple


@pytest.fixture(scope="module")
def regression_at_its_minimum():
    data = load_diabetes()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / x.std(0)
    y = torch.tensor(data.target, dtype=torch.float32)
    y = ((y - y.mean()) / y.std()).unsqueeze(1)
    solution = torch.linalg.lstsq(torch.cat([x, torch.ones(len(x), 1)], 1).double(), y.double()).solution
    model = nn.Linear(10, 1)
    with torch.no_grad():
        model.weight.copy_(solution[:10, 0].float().view(1, 10))
        model.bias.copy_(solution[10].float())
    exact, _, _ = exact_b_simple(model, F.mse_loss, x, y)
    return model, x, y, exact


@pytest.mark.parametrize("seed", range(5))
def test_no_estimate_reads_a_finite_noise_scale_that_shuts_out_the_unbounded_one(regression_at_its_minimum, seed):
    model, x, y, exact = regression_at_its_minimum
    assert exact > 1e12
    generator = torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(model, method="per_example") as meter:
        for _ in range(300):
            rows = torch.randint(0, len(x), (16,), generator=generator)
            F.mse_loss(model(x[rows]), y[rows]).backward()
            meter.step()
            model.zero_grad()
    for estimate in (meter.estimate, meter.run_estimate):
        assert estimate.ci_high == math.inf
        assert estimate.b_simple > 0.0
        assert estimate.grad_sq_norm > 0.0 or estimate.b_simple == math.inf
