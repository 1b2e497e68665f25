"""Whether each parameter's gradient is the sum of its layers' per-example gradients (check 1 of :mod:`.checks`).

The tracker hands each measured call of a layer here (its input and output gradient, batch first), and then each
parameter's whole gradient: the layer's own weight gradient is recomputed over every example of the call
(``summed_grads``, the same functions the subset path uses) and set against the parameter's gradient. What is left,
``R = grad − S``, is what no example's norm carries. Run once per fit, by :mod:`.checks`: it costs one more weight
gradient per layer. Torch only, no Lightning.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor, nn

__all__ = ["Extra", "SumCheck"]

#: Per parameter: its layers' summed per-example gradient ``S``, the rest of its gradient ``R``, the sum's rounding.
Extra = tuple[Tensor, Tensor, float]
SummedGrads = Callable[..., dict[str, Tensor]]


class SumCheck:
    """One backward pass's comparison; read :attr:`extra_gradients` and :attr:`summed_sq_norms` after it."""

    def __init__(self) -> None:
        self.extra_gradients: dict[str, Extra] = {}
        #: ``Σ_i |g_i|²`` over every compared layer, the examples' scale (``tr Σ`` is ``B`` times it less ``|ḡ|²``).
        self.summed_sq_norms = 0.0
        self._pending: dict[int, tuple[Tensor, float]] = {}  # parameter id → (S, its layers' Σ_i |g_i|²)

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
        for local_name, value in summed.items():
            key = id(module.get_parameter(local_name))
            before, size = self._pending.get(key, (0.0, 0.0))
            self._pending[key] = (value + before, sq_norm_sum + size)

    def compare(self, param_name: str, param_id: int, grad: Tensor, batch_size: int) -> None:
        """Keep ``(S, R, rounding)`` for a parameter whose whole gradient arrived: the rounding of the sum is
        ``100·ε·(B·Σ_i |g_i|²)^½`` with ``ε`` the gradient's machine epsilon (1e-5 in float32; in bf16 nearly the
        gradient itself, so that a model held in bf16 is hardly checked)."""
        summed, magnitude = self._pending.pop(param_id, (None, 0.0))
        if summed is None or grad.layout != torch.strided:
            return
        with torch.no_grad():
            summed = summed.float()
            rounding = 100 * torch.finfo(grad.dtype).eps * (magnitude * batch_size) ** 0.5
            self.extra_gradients[param_name] = (summed, grad.float() - summed, rounding)
