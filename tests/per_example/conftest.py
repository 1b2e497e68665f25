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
