"""Whether each parameter's gradient is the sum of its layers' per-example gradients (check 1 of :mod:`.checks`).

The tracker hands each measured call of a layer here (its input and output gradient, batch first), and then each
parameter's whole gradient: the layer's own weight gradient is recomputed over every example of the call
(``summed_grads``, the same functions the subset path uses) and set against the parameter's gradient. What is left,
``R = grad − S``, is what no example's norm carries. Run once per fit: it costs one more weight gradient per layer.
Torch only, no Lightning.

Two users: :mod:`.checks` runs two passes and keeps ``(S, R)`` per parameter to compare them; the meter, where that
check was not run, checks its first measured training step alone (``keep_tensors=False``: a :class:`Rest` of host
floats per parameter, no copy of the model's gradient kept).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
from torch import Tensor, nn

__all__ = ["Extra", "Rest", "SumCheck"]

#: Per parameter: its layers' summed per-example gradient ``S``, the rest of its gradient ``R``, the sum's rounding.
Extra = tuple[Tensor, Tensor, float]
SummedGrads = Callable[..., dict[str, Tensor]]


class Rest(NamedTuple):
    """One parameter's comparison as host floats (NaN where its gradient was not finite)."""

    norm: float  # |R|
    whole: float  # |S + R|, the parameter's gradient
    rounding: float  # the largest |R| read as the sum's rounding
    off_parameter: float  # |R − cθ| with c = R·θ / |θ|²: 0 where R is a multiple of the parameter (an L2 term)
    summed_dot_rest: float  # S·R
    summed_sq: float  # |S|²
    epsilon: float  # the machine epsilon the rounding was read at

    @property
    def finite(self) -> bool:
        return all(map(math.isfinite, (self.norm, self.whole, self.off_parameter, self.summed_dot_rest)))


class SumCheck:
    """One backward pass's comparison; read :attr:`extra_gradients` (or :attr:`rests`) and :attr:`summed_sq_norms`
    after it."""

    def __init__(self, keep_tensors: bool = True) -> None:
        self.keep_tensors = keep_tensors
        self.extra_gradients: dict[str, Extra] = {}
        #: Per parameter compared: its :class:`Rest`.
        self.rests: dict[str, Rest] = {}
        #: ``Σ_i |g_i|²`` over every compared layer, the examples' scale (``tr Σ`` is ``B`` times it less ``|ḡ|²``).
        self.summed_sq_norms = 0.0
        self.batch_size = 1  # of the pass compared
        # parameter id → (S, its layers' Σ_i |g_i|², the largest machine epsilon their inputs were computed in)
        self._pending: dict[int, tuple[Tensor, float, float]] = {}

    def add_call(self, module: nn.Module, summed_grads: Optional[SummedGrads], param_names: frozenset[str],
                 inp: Tensor, grad_output: Tensor, sq_norm_sum: float) -> None:
        """One call's summed gradient per parameter (``summed_grads`` of every example), and ``sq_norm_sum``, its
        examples' ``Σ_i |g_i|²`` (from those measured, scaled to the batch). Layers without ``summed_grads``
        (attention, recurrent, bag) are not compared."""
        if summed_grads is None:
            return
        with torch.no_grad():
            summed = summed_grads(module, inp, grad_output, param_names=param_names)
        self.summed_sq_norms += sq_norm_sum
        eps = max(_eps(inp), _eps(grad_output))
        for local_name, value in summed.items():
            key = id(module.get_parameter(local_name))
            before, size, low = self._pending.get(key, (0.0, 0.0, 0.0))
            self._pending[key] = (value + before, sq_norm_sum + size, max(eps, low))

    def compare(self, param_name: str, param_id: int, grad: Tensor, batch_size: int,
                param: Optional[Tensor] = None) -> None:
        """Keep ``(S, R, rounding)`` for a parameter whose whole gradient arrived: the rounding of the sum is
        ``100·ε·(B·Σ_i |g_i|²)^½`` with ``ε`` the gradient's machine epsilon (1e-5 in float32; in bf16 nearly the
        gradient itself, so that a model held in bf16 is hardly checked). Where the layers computed in lower
        precision than the gradient (autocast), ``ε`` is theirs. ``param``, the parameter itself, tells whether
        ``R`` is a multiple of it (:attr:`Rest.off_parameter`)."""
        summed, magnitude, eps = self._pending.pop(param_id, (None, 0.0, 0.0))
        if summed is None or grad.layout != torch.strided:
            return
        self.batch_size = batch_size
        with torch.no_grad():
            summed = summed.float()
            eps = max(eps, torch.finfo(grad.dtype).eps)
            rounding = _rounding(eps, magnitude, batch_size)
            rest = grad.float() - summed
            self.rests[param_name] = _rest(summed, rest, grad, rounding, param, eps)
            if self.keep_tensors:
                self.extra_gradients[param_name] = (summed, rest, rounding)

    def beyond_rounding(self) -> dict[str, Rest]:
        """The rests larger than rounding: of their own layers' sum (:meth:`compare`), and of the whole model's,
        ``100·ε·(B·Σ_i |g_i|²)^½`` over every compared layer. A parameter whose gradient cancels to about zero inside
        autograd (GroupNorm's bias under an InstanceNorm, which removes every per-channel shift) keeps the rounding of
        the terms that cancelled, on the model's scale; read against its layer's own tiny norms, that rounding was
        refused as 78% of its gradient "used outside its layer". A rest under the model's rounding moves neither
        ``tr Σ`` nor ``|G|²`` by more than about 1e-8 of the examples' scale."""
        return {name: rest for name, rest in self.rests.items()
                if rest.norm > max(rest.rounding, _rounding(rest.epsilon, self.summed_sq_norms, self.batch_size))}


def _rounding(eps: float, sq_norm_sum: float, batch_size: int) -> float:
    """The largest rest read as rounding of a sum over examples whose ``Σ_i |g_i|²`` is ``sq_norm_sum``:
    ``100·ε·(B·Σ_i |g_i|²)^½``."""
    return 100 * eps * (sq_norm_sum * batch_size) ** 0.5


def _rest(summed: Tensor, rest: Tensor, grad: Tensor, rounding: float, param: Optional[Tensor], eps: float) -> Rest:
    norm = off = float(rest.norm())
    if param is not None:
        theta = param.detach().float()
        off = float((rest - (rest * theta).sum() / (theta * theta).sum().clamp_min(1e-30) * theta).norm())
    return Rest(norm, float(grad.float().norm()), rounding, off, float((summed * rest).sum()),
                float(summed.pow(2).sum()), eps)


def _eps(tensor: Tensor) -> float:
    return torch.finfo(tensor.dtype).eps if tensor.is_floating_point() else 0.0
