""":mod:`gns_callback.per_example.sum_check`: what is left of a parameter's gradient once its layers' per-example
gradients are summed, against autograd."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.sum_check import SumCheck


@pytest.mark.parametrize("penalty", [0.0, 0.01])
def test_the_rest_is_what_the_loss_adds_to_the_parameters(penalty):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.LayerNorm(5), nn.Linear(5, 3))
    x, y = torch.randn(12, 6), torch.randint(0, 3, (12,))
    tracker = PerExampleNormTracker(model)
    tracker.sum_check = check = SumCheck()
    with tracker:
        loss = F.cross_entropy(model(x), y) + penalty * sum(p.pow(2).sum() for p in model.parameters())
        loss.backward()
        tracker.pop()
    assert set(check.extra_gradients) == {f"{i}.{n}" for i in (0, 2, 3) for n in ("weight", "bias")}
    for name, param in model.named_parameters():
        summed, rest, rounding = check.extra_gradients[name]
        assert torch.allclose(rest, 2 * penalty * param.detach(), atol=1e-6), name
        assert torch.allclose(summed + rest, param.grad, atol=1e-7)
        assert 0 < rounding < 1e-4
    assert check.summed_sq_norms > 0
