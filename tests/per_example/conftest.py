"""Shared torch.func reference for per-example squared gradient norms."""

from __future__ import annotations

from collections.abc import Callable, Collection

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

ReferenceFn = Callable[..., Tensor]


def per_example_sq_norms_reference(
    model: nn.Module,
    inputs: Tensor,
    output_weights: Tensor,
    param_names: Collection[str] | None = None,
) -> Tensor:
    """``Σ_params |∇_θ (model(x_i)·R_i).sum()|²`` per example, via ``vmap(grad(...))``.

    With loss ``Σ_i (model(x_i)·R_i).sum()`` the gradient w.r.t. the output is exactly ``R``, so the
    layer functions are called with ``grad_output=R``. ``param_names`` (qualified names) restricts the
    parameters; default: all trainable ones.
    """
    named = dict(model.named_parameters())
    trainable = {
        name: param.detach()
        for name, param in named.items()
        if param.requires_grad and (param_names is None or name in param_names)
    }
    fixed = {name: param.detach() for name, param in named.items() if name not in trainable}
    fixed.update(dict(model.named_buffers()))

    def example_loss(params: dict[str, Tensor], x: Tensor, weights: Tensor) -> Tensor:
        out = functional_call(model, {**fixed, **params}, (x.unsqueeze(0),))
        return (out * weights.unsqueeze(0)).sum()

    grads = vmap(grad(example_loss), in_dims=(None, 0, 0))(trainable, inputs, output_weights)
    total = torch.zeros(inputs.shape[0], dtype=torch.float64)
    for value in grads.values():
        total = total + value.reshape(value.shape[0], -1).double().square().sum(dim=1)
    return total


@pytest.fixture
def reference_sq_norms() -> ReferenceFn:
    return per_example_sq_norms_reference


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def assert_tracked_whole(model: nn.Module, inputs: Tensor, rtol: float) -> None:
    """One backward pass of ``(model(inputs) · R).sum()`` under a tracker: every parameter covered, each example's
    squared norm :func:`per_example_sq_norms_reference`'s (read in float32: ``rtol`` from 1e-6)."""
    from gns_callback.per_example import PerExampleNormTracker

    weights = torch.randn_like(model(inputs))
    with PerExampleNormTracker(model) as tracker:
        assert tracker.coverage_fraction() == 1.0
        (model(inputs) * weights).sum().backward()
        got = tracker.pop()
    torch.testing.assert_close(got.double(), per_example_sq_norms_reference(model, inputs, weights), rtol=rtol, atol=0)


@pytest.fixture
def tracked_whole() -> Callable[[nn.Module, Tensor, float], None]:
    return assert_tracked_whole


@pytest.fixture
def assert_subset_reads_exactly(monkeypatch, reference_sq_norms) -> Callable[[nn.Module], None]:
    """``check(model)`` for a model taking (10, 8) inputs (or ``x``, 10 examples): with a subset of 4 examples
    forced, the measured examples' norms and ``|Σ_{i unmeasured} g_i|²`` equal the brute-force ones, as for a
    layer's."""
    from gns_callback.per_example import PerExampleNormTracker
    from gns_callback.per_example import tracker as tracker_module

    monkeypatch.setattr(tracker_module, "subset_is_cheaper", lambda *args: True)

    def check(model: nn.Module, x: Tensor | None = None) -> None:
        x = torch.randn(10, 8) if x is None else x
        weights = torch.randn_like(model(x))
        tracker = PerExampleNormTracker(model, max_examples=4).attach()
        model.zero_grad()
        (model(x) * weights).sum().backward()
        (record,) = tracker.pop_passes()
        assert record.subset and tracker.coverage_fraction() == 1.0
        torch.testing.assert_close(record.sq_norms, reference_sq_norms(model, x, weights).float()[:4], rtol=1e-4,
                                   atol=0)
        model.zero_grad()
        (model(x[4:]) * weights[4:]).sum().backward()
        rest = sum(p.grad.double().square().sum() for p in model.parameters())
        torch.testing.assert_close(record.unmeasured_sq.double(), rest, rtol=1e-4, atol=0)

    return check

