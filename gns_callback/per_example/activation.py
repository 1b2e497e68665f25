"""Per-example squared gradient norms for ``nn.PReLU``: ``y = x`` where ``x > 0``, else ``a·x``.

``∂y/∂a = min(x, 0)``, so example ``i`` contributes ``Σ_positions min(x_i, 0) ⊙ δ_i`` to ``a``'s gradient: per
channel (dim 1 of the input) for ``num_parameters = C``, over everything but the batch for a single ``a``. Torch
only.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import Tensor, nn

from .linear import includes_param, upcast

__all__ = ["prelu_sq_norms", "prelu_summed_grads"]


def _per_example(module: nn.PReLU, inp: Tensor, grad_output: Tensor) -> Tensor:
    """Each example's gradient of ``a``: (B, num_parameters)."""
    inp, grads = upcast(inp, grad_output)
    batch_size, contributions = inp.shape[0], inp.clamp(max=0).mul_(grads)
    if module.num_parameters == 1:
        return contributions.reshape(batch_size, 1, -1).sum(dim=2)
    return contributions.reshape(batch_size, module.num_parameters, -1).sum(dim=2)


def prelu_sq_norms(module: nn.PReLU, inp: Tensor, grad_output: Tensor, *,
                   param_names: Collection[str] | None = None) -> Tensor:
    """``|Σ_pos min(x_i, 0) ⊙ δ_i|²`` per example (B,), float32 (float64 kept)."""
    if inp.dim() < 2:
        raise ValueError(f"PReLU input needs a leading batch dimension and features, got shape {tuple(inp.shape)}")
    if not includes_param(module, "weight", param_names):
        return upcast(grad_output)[0].new_zeros(inp.shape[0])
    return _per_example(module, inp, grad_output).square().sum(dim=1)


def prelu_summed_grads(module: nn.PReLU, inp: Tensor, grad_output: Tensor, *,
                       param_names: Collection[str] | None = None) -> dict[str, Tensor]:
    """The gradient of ``a`` these examples alone contribute."""
    if not includes_param(module, "weight", param_names):
        return {}
    return {"weight": _per_example(module, inp, grad_output).sum(dim=0).reshape(module.weight.shape)}
