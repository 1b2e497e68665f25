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
    in float64 (``_foreach_norm`` refuses to narrow them), the rest accumulated in float32; sparse tensors (an
    ``nn.Embedding(sparse=True)``'s gradient, which ``_foreach_norm`` can't read) one by one, by their values."""
    dense = [t for t in tensors if t.layout == torch.strided]
    sums = [squared_norm(t) for t in tensors if t.layout != torch.strided]
    for dtype, group in ((torch.float64, [t for t in dense if t.dtype == torch.float64]),
                         (torch.float32, [t for t in dense if t.dtype != torch.float64])):
        if group:
            sums.append(torch.stack(torch._foreach_norm(group, 2, dtype=dtype)).square().sum().float())
    if not sums:
        return torch.zeros(())  # no gradient at all (cleared before the read): zero
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()
