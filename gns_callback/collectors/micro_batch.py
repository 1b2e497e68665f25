"""Squared norms of each micro-batch's local gradient, from parameter hooks (torch, no Lightning).

``Tensor.register_hook`` on a parameter sees the gradient of one backward pass *before* it is accumulated
into ``.grad`` and before DDP reduces it: exactly one micro-batch's local gradient (still carrying the
AMP loss scale and Lightning's ``1/accumulate_grad_batches`` factor — the caller rescales).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.utils.hooks import RemovableHandle


class MicroBatchGradNorms:
    """Sums ``|∂L/∂p|²`` over hooked parameters for each backward pass."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._parts: list[torch.Tensor] = []

    def attach(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.detach()
        for p in params:
            self._handles.append(p.register_hook(self._on_grad))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._parts.clear()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def _on_grad(self, grad: torch.Tensor) -> None:
        if grad.dtype in (torch.float32, torch.float64):
            flat = grad.reshape(-1)
            self._parts.append(torch.dot(flat, flat).float())  # one kernel, about half a vector_norm's cost
        else:  # fp16/bf16 (16-true): accumulate in float32, squares would overflow
            self._parts.append(torch.linalg.vector_norm(grad, dtype=torch.float32).square())

    def pop(self) -> torch.Tensor | None:
        """``Σ_p |grad_p|²`` of the backward pass(es) since the last pop, or None if no hook fired."""
        if not self._parts:
            return None
        total = torch.stack(self._parts).sum()
        self._parts.clear()
        return total
