"""Brute-force references the tests compare against (no gns_callback code inside)."""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, vmap


def per_example_gradients(model: torch.nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(N, P) matrix of per-example gradients of ``loss_fn(model(x_i), y_i)`` over trainable parameters."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss_one(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    rows = []
    for start in range(0, x.shape[0], chunk):
        g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x[start : start + chunk], y[start : start + chunk])
        rows.append(torch.cat([v.reshape(v.shape[0], -1) for v in g.values()], dim=1))
    return torch.cat(rows).double()


def exact_noise_scale(per_example: torch.Tensor) -> tuple[float, float, float]:
    """``(B_simple, |G|², tr Σ)`` of the empirical distribution of the rows (sampling with replacement)."""
    mean = per_example.mean(0)
    trace = (per_example - mean).pow(2).sum(1).mean().item()
    grad_sq = mean.pow(2).sum().item()
    return trace / grad_sq, grad_sq, trace
