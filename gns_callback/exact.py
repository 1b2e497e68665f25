"""Exact ``B_simple`` by brute force: every per-example gradient over a whole data set, at fixed parameters.

Independent of the estimators (it uses ``torch.func`` per-sample gradients); the tests and benchmarks compare
against it, and a user can use it to check the callback on their own (small) model and data.
"""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, vmap


def per_example_gradients(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(N, P) float64 matrix of per-example gradients of ``loss_fn(model(x_i), y_i)`` over trainable parameters.

    ``torch.func.vmap`` over the examples; where a layer has no batching rule that works (``nn.GRU``'s in-place
    update), one backward pass per example instead: the same gradients, more slowly."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss_one(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    rows = []
    try:
        for start in range(0, x.shape[0], chunk):
            g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x[start : start + chunk], y[start : start + chunk])
            rows.append(torch.cat([v.reshape(v.shape[0], -1) for v in g.values()], dim=1))
    except RuntimeError:
        return _looped_gradients(model, loss_fn, x, y)
    return torch.cat(rows).double()


def _looped_gradients(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """:func:`per_example_gradients` by one backward pass per example (a sparse gradient, of
    ``nn.Embedding(sparse=True)``, made dense)."""
    params = [v for v in model.parameters() if v.requires_grad]
    rows = []
    for xi, yi in zip(x, y):
        grads = torch.autograd.grad(loss_fn(model(xi.unsqueeze(0)), yi.unsqueeze(0)), params, allow_unused=True)
        rows.append(torch.cat([_dense(p, g).reshape(-1) for p, g in zip(params, grads)]))
    return torch.stack(rows).double()


def _dense(param: torch.Tensor, grad) -> torch.Tensor:
    """``grad`` of ``param`` as a dense tensor (zeros where the parameter was not used)."""
    if grad is None:
        return torch.zeros_like(param)
    return grad.to_dense() if grad.is_sparse else grad


def exact_noise_scale(per_example: torch.Tensor) -> tuple[float, float, float]:
    """``(B_simple, |G|², tr Σ)`` of the empirical distribution of the rows (sampling with replacement):
    ``G = mean_i g_i``, ``tr Σ = mean_i |g_i − G|²``."""
    mean = per_example.mean(0)
    trace = (per_example - mean).pow(2).sum(1).mean().item()
    grad_sq = mean.pow(2).sum().item()
    return trace / grad_sq, grad_sq, trace


def exact_b_simple(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
    """``(B_simple, |G|², tr Σ)`` of ``model`` on the data set ``(x, y)``, for a per-example ``loss_fn``."""
    return exact_noise_scale(per_example_gradients(model, loss_fn, x, y))
