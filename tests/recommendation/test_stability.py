import math

import pytest
import torch

from gns_callback.recommendation.stability import Momentum, cap_increase, momentum_of, stability_limit


def _distance_after(lr: float, curvature: float, steps: int = 3000, **sgd) -> float:
    """|w| after ``steps`` of torch.optim.SGD on 0.5·curvature·w², from w = 1."""
    w = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([w], lr=lr, **sgd)
    for _ in range(steps):
        opt.zero_grad()
        (0.5 * curvature * w**2).sum().backward()
        opt.step()
    return abs(w.item())


@pytest.mark.parametrize(
    "sgd", [{}, {"momentum": 0.9}, {"momentum": 0.9, "dampening": 0.5}, {"momentum": 0.5, "nesterov": True},
            {"momentum": 0.9, "nesterov": True}]
)
def test_limit_is_exactly_where_torch_sgd_stops_converging_on_a_quadratic(sgd):
    limit = stability_limit(4.0, Momentum(sgd.get("momentum", 0.0), sgd.get("dampening", 0.0),
                                          sgd.get("nesterov", False)))
    assert _distance_after(0.99 * limit, 4.0, **sgd) < 1e-6
    assert _distance_after(1.01 * limit, 4.0, **sgd) > 1e6


def test_closed_forms_and_no_limit_without_positive_curvature():
    assert stability_limit(2.0) == pytest.approx(1.0)
    assert stability_limit(2.0, Momentum(0.9)) == pytest.approx(1.9)
    assert stability_limit(2.0, Momentum(0.9, nesterov=True)) == pytest.approx((2 + 2 * 0.9) / ((1 + 2 * 0.9) * 2.0))
    assert stability_limit(0.0) == math.inf and stability_limit(-3.0) == math.inf
    with pytest.raises(ValueError, match="sharpness"):
        stability_limit(math.nan)
    with pytest.raises(ValueError, match="momentum"):
        stability_limit(1.0, Momentum(1.0))


def test_momentum_read_from_an_optimizer_instance_only():
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert momentum_of(torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)) == Momentum(0.9, 0.0, True)
    assert momentum_of(torch.optim.SGD(p, lr=0.1)) == Momentum()
    assert momentum_of(torch.optim.SGD) is None and momentum_of("SGD") is None and momentum_of(None) is None


def test_cap_only_limits_increases_and_never_goes_below_the_current_lr():
    assert cap_increase(2.0, 0.5, 1.0) == 1.0  # increase past the limit: capped
    assert cap_increase(0.8, 0.5, 1.0) == 0.8  # increase below the limit: kept
    assert cap_increase(2.0, 1.5, 1.0) == 1.5  # already past the limit: no increase, but not lowered
    assert cap_increase(0.2, 0.5, 0.1) == 0.2  # a decrease is never capped
