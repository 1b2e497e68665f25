"""Weight-normalised ``nn.Linear``, ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d`` layers (Salimans & Kingma
2016), measured per example.

``torch.nn.utils.parametrizations.weight_norm`` (and the older hook-based ``torch.nn.utils.weight_norm``) replace a
layer's ``weight`` by ``W = g · v / ‖v‖``, the norm taken over every dim but ``dim`` (over all of them for
``dim=None``, stored as -1). The trainable parameters are then ``g`` and ``v``, not ``W``. Per row ``r`` (an index
along ``dim``), with ``G_i`` example ``i``'s gradient of ``W``, ``v̂ = v/‖v‖`` and ``s = g/‖v‖``:

    ∇g_{i,r} = ⟨G_{i,r}, v̂_r⟩                       (the row's projection p_{i,r})
    ∇v_{i,r} = s_r · (G_{i,r} − p_{i,r} · v̂_r)
    |∇g_i|² + |∇v_i|² = Σ_r p_{i,r}² + s_r² · (|G_{i,r}|² − p_{i,r}²)

so each example's norm needs its rows' projections and squared norms: a Linear's from its activations and output
gradients (a forward product and a ``T × T`` Gram per example, :func:`_linear_rows`), a convolution's from its
materialised per-example weight gradients (:func:`conv_weight_grads`, one weight-gradient computation per layer).
The summed gradient of a set of examples is the same map applied to their summed ``G``. Only this one parametrization is recognised: any other (spectral or orthogonal norms, a weight
dropout) may hold state or randomness its gradient depends on, and its parameters stay left out, as before.

Torch only, no Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm

from .conv import per_example_weight_grads
from .conv_transpose import shadow_convolution
from .linear import upcast

__all__ = ["WeightNormed", "conv_weight_grads", "example_rows", "plain_type", "unit_and_scale", "weight_norm_grads",
           "weight_norm_sq_norms", "weight_normed", "weight_normed_owner", "weight_normed_sq_norms",
           "weight_normed_summed_grads"]

#: Transposed convolutions, whose per-example weight gradients are their shadow convolution's (:mod:`.conv_transpose`).
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)

#: The layers whose weight-normalised weight is measured (:func:`example_rows` reads each kind's rows).
_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, *_TRANSPOSED)

#: The parametrized form's originals: ``original0`` is ``g``, ``original1`` is ``v``.
_PARAMETRIZED = ("parametrizations.weight.original0", "parametrizations.weight.original1")


@dataclass(frozen=True)
class WeightNormed:
    """Where a layer keeps ``g`` and ``v`` (local parameter names) and the dim its norm keeps (-1: none)."""

    g_name: str
    v_name: str
    dim: int


def plain_type(module: nn.Module) -> type:
    """``module``'s class, or, for a layer whose only parametrization is ``weight_norm``, the class it
    parametrizes (``ParametrizedLinear`` → ``nn.Linear``: the forward is the same)."""
    cls = type(module)
    if parametrize.is_parametrized(module) and weight_normed(module) is not None:
        return cls.__bases__[0]
    return cls


def weight_normed(module: nn.Module) -> Optional[WeightNormed]:
    """How ``module``'s weight is weight-normalised, or None: not a Linear or convolution, not normalised, or
    parametrized in any other way too."""
    if parametrize.is_parametrized(module):
        chain = module.parametrizations["weight"] if set(module.parametrizations.keys()) == {"weight"} else None
        found = (chain[0].dim if chain is not None and len(chain) == 1
                 and type(chain[0]).__name__ == "_WeightNorm" else None)
        base = type(module).__bases__[0]
        return _checked(module, WeightNormed(*_PARAMETRIZED, found), base) if found is not None else None
    hooks = [hook for hook in module._forward_pre_hooks.values()
             if isinstance(hook, WeightNorm)]
    if len(hooks) == 1 and hooks[0].name == "weight":
        return _checked(module, WeightNormed("weight_g", "weight_v", hooks[0].dim), type(module))
    return None


def _checked(module: nn.Module, found: WeightNormed, base: type) -> Optional[WeightNormed]:
    """``found`` where the layer is one of :data:`_LAYERS` and ``v`` has a dim ``dim`` names (or ``dim`` is -1)."""
    v = module.get_parameter(found.v_name)
    return found if base in _LAYERS and (found.dim == -1 or 0 <= found.dim < v.dim()) else None


def weight_normed_owner(module: nn.Module) -> Optional[nn.Module]:
    """The module that registers ``g`` and ``v`` when it is not the layer itself (the parametrized form's
    ``ParametrizationList``), so that its parameters are read as the layer's; else None."""
    found = weight_normed(module)
    return module.parametrizations.weight if found is not None and found.g_name == _PARAMETRIZED[0] else None


def weight_norm_sq_norms(projections: Tensor, row_sq: Tensor, scale: Tensor, use_g: bool, use_v: bool) -> Tensor:
    """``|∇g_i|² + |∇v_i|²`` per example (the module docstring's formula) from each example's rows' projections
    ``p_{i,r}`` and squared norms ``|G_{i,r}|²`` (:func:`example_rows`) and the rows' scales ``s_r``."""
    projection_sq = projections.square()
    total = projection_sq if use_g else torch.zeros_like(projection_sq)
    if use_v:
        total = total + scale.square() * (row_sq - projection_sq).clamp_min(0)
    return total.flatten(1).sum(dim=1)


def weight_norm_grads(summed: Tensor, g: Tensor, v: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``(∇g, ∇v)`` for the weight gradient ``summed`` (the module docstring's formula)."""
    unit, scale = unit_and_scale(g, v, dim)
    summed = upcast(summed)[0]
    projections, _ = _materialised_rows(summed.unsqueeze(0), unit, dim)
    return projections[0].reshape(g.shape), scale * (summed - projections[0] * unit)


def unit_and_scale(g: Tensor, v: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``v̂ = v/‖v‖`` and ``s = g/‖v‖`` (float32 at least), the norm over every dim but ``dim``."""
    g, v = upcast(g, v)
    norms = torch.norm_except_dim(v, 2, dim)
    return v / norms, (g.reshape(norms.shape) if g.dim() else g) / norms


def example_rows(module: nn.Module, inp: Tensor, grad_output: Tensor, unit: Tensor,
                 dim: int) -> tuple[Tensor, Tensor]:
    """Per example and row: ``p_{i,r} = ⟨G_{i,r}, v̂_r⟩`` and ``|G_{i,r}|²`` (B, then the weight's dims with the
    reduced ones kept as 1). A Linear's without its ``(B, out, in)`` gradients (:func:`_linear_rows`); a
    convolution's from its materialised ones."""
    if isinstance(module, nn.Linear):
        return _linear_rows(inp, grad_output, unit, dim)
    return _materialised_rows(conv_weight_grads(module, inp, grad_output), unit, dim)


def _materialised_rows(grads: Tensor, unit: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    reduced = tuple(d + 1 for d in range(unit.dim()) if d != dim)
    return (grads * unit).sum(dim=reduced, keepdim=True), grads.square().sum(dim=reduced, keepdim=True)


def _linear_rows(inp: Tensor, grad_output: Tensor, unit: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """:func:`example_rows` of a Linear, ``G_i = Σ_t δ_t a_tᵀ``, from its activations ``A`` (B, T, in) and output
    gradients ``Δ`` (B, T, out) alone. Per output row (``dim=0``): ``p_{i,l} = Σ_t Δ_{tl}·(A_t·v̂_l)`` and
    ``|G_{i,l}|² = Σ_{t,s} Δ_{tl} Δ_{sl} (A_t·A_s)``; per input column (``dim=1``) the same with ``A`` and ``Δ``
    swapped and ``v̂`` transposed; over the whole weight (``dim=-1``) their sums. Costs a forward product and a
    ``T × T`` Gram per example, the memory of the activations (no ``out × in`` per example)."""
    activations, grads = upcast(inp, grad_output)
    batch_size = activations.shape[0]
    activations = activations.reshape(batch_size, -1, activations.shape[-1])
    grads = grads.reshape(batch_size, -1, grads.shape[-1])
    if dim == 1:
        projections, row_sq = _output_rows(grads, activations, unit.t())
        return projections.unsqueeze(1), row_sq.unsqueeze(1)
    projections, row_sq = _output_rows(activations, grads, unit)
    if dim == -1:
        return projections.sum(dim=1).reshape(-1, 1, 1), row_sq.sum(dim=1).reshape(-1, 1, 1)
    return projections.unsqueeze(2), row_sq.unsqueeze(2)


def _output_rows(activations: Tensor, grads: Tensor, unit: Tensor) -> tuple[Tensor, Tensor]:
    """``(B, out)`` projections and squared norms of the rows of ``Σ_t δ_t a_tᵀ`` (:func:`_linear_rows`)."""
    projections = (grads * (activations @ unit.t())).sum(dim=1)
    gram = activations @ activations.transpose(1, 2)  # (B, T, T): |a|² for T = 1
    return projections, ((gram @ grads) * grads).sum(dim=1)


def conv_weight_grads(module: nn.Module, inp: Tensor, grad_output: Tensor) -> Tensor:
    """Per-example weight gradients (B, *weight shape) of a convolution or a transposed convolution."""
    batch_size = inp.shape[0]
    inp, grad_output = upcast(inp, grad_output)
    if isinstance(module, _TRANSPOSED):  # weight (in, out/groups, *kernel): the shadow convolution's, roles swapped
        grads = per_example_weight_grads(shadow_convolution(module), grad_output, inp)
        return grads.reshape(batch_size, module.in_channels, module.out_channels // module.groups, *module.kernel_size)
    grads = per_example_weight_grads(module, inp, grad_output)  # a Conv1d's with a height of 1 added
    return grads.reshape(batch_size, module.out_channels, module.in_channels // module.groups, *module.kernel_size)


def weight_normed_sq_norms(base: Callable[..., Tensor], module: nn.Module, inp: Tensor, grad_output: Tensor, *,
                           param_names: Collection[str]) -> Tensor:
    """The layer's per-example squared norms over ``param_names``: ``g`` and ``v`` here, the rest (its bias) by
    the layer's own function ``base``."""
    found = weight_normed(module)
    rest = set(param_names) - {found.g_name, found.v_name}
    total = base(module, inp, grad_output, param_names=rest).float() if rest else None
    use_g, use_v = found.g_name in param_names, found.v_name in param_names
    if use_g or use_v:
        unit, scale = unit_and_scale(module.get_parameter(found.g_name).detach(),
                                     module.get_parameter(found.v_name).detach(), found.dim)
        projections, row_sq = example_rows(module, inp, grad_output, unit, found.dim)
        part = weight_norm_sq_norms(projections, row_sq, scale, use_g, use_v)
        total = part if total is None else total + part
    return total


def weight_normed_summed_grads(base: Callable[..., dict[str, Tensor]], module: nn.Module, inp: Tensor,
                               grad_output: Tensor, *, param_names: Collection[str]) -> dict[str, Tensor]:
    """The gradient of ``param_names`` these examples alone contribute: ``g``'s and ``v``'s from their summed
    weight gradient, the rest by the layer's own function ``base``."""
    found = weight_normed(module)
    rest = set(param_names) - {found.g_name, found.v_name}
    if found.g_name not in param_names and found.v_name not in param_names:
        return base(module, inp, grad_output, param_names=rest) if rest else {}
    summed = base(module, inp, grad_output, param_names=rest | {"weight"})  # W computed: g·v/‖v‖
    g_grad, v_grad = weight_norm_grads(summed.pop("weight"), module.get_parameter(found.g_name).detach(),
                                       module.get_parameter(found.v_name).detach(), found.dim)
    summed.update({name: grad for name, grad in ((found.g_name, g_grad), (found.v_name, v_grad))
                   if name in param_names})
    return summed
