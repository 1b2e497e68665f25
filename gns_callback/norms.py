"""Squared norms of gradients on their device, accumulated in float32 (fp16/bf16 squares would overflow).

Shared by the collectors' hooks and the meter; torch only, no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def squared_norm(tensor: torch.Tensor) -> torch.Tensor:
    """``|t|²`` as a float32 0-d tensor: one kernel for a dense float32/float64 tensor (a dot product, about half a
    ``vector_norm``'s cost); sparse tensors by their stored values."""
    if tensor.layout != torch.strided:
        tensor = tensor.coalesce().values()
    if tensor.dtype in (torch.float32, torch.float64):
        flat = tensor.reshape(-1)
        return torch.dot(flat, flat).float()
    return torch.linalg.vector_norm(tensor, dtype=torch.float32).square()


def squared_norm_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``Σ_t |t|²`` as a float32 0-d tensor, in a few multi-tensor kernels (``torch._foreach_norm``): float64 tensors
    in float64 (``_foreach_norm`` refuses to narrow them), the rest accumulated in float32."""
    wide = [t for t in tensors if t.dtype == torch.float64]
    narrow = [t for t in tensors if t.dtype != torch.float64]
    sums = [torch.stack(torch._foreach_norm(group, 2, dtype=dtype)).square().sum().float()
            for group, dtype in ((narrow, torch.float32), (wide, torch.float64)) if group]
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()
