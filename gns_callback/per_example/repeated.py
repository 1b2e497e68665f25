"""A layer applied several times in one forward pass: its calls read as one call over all their positions.

Example ``i``'s gradient of a layer applied ``C`` times is the sum of each call's, ``Σ_c G_{i,c}``, and the norm of
a sum is not the sum of norms. For layers whose per-example gradient sums over positions independently (a linear
map, ``Σ_t δ_t a_tᵀ``; an embedding's rows; a LayerNorm or RMSNorm, which normalises each position on its own),
``Σ_c Σ_t`` is one sum over the positions of every call: concatenating the calls' inputs and output gradients along
a position dimension gives exactly the layer's per-example gradient, and the layer's own norm function reads it.
This covers a hand-written recurrence (one ``nn.Linear`` applied at every step), a siamese encoder applied to two
inputs and a weight-tied block applied repeatedly. A PReLU acts on each element on its own: its calls concatenate
along the positions after its channels (``(B, num_parameters, positions)``), as one ``nn.PReLU`` module called
after every layer of a network would have it. Convolutions and GroupNorm (whose statistics span the positions
of one call) are not combined this way; applied twice, they still stop measuring, with the reason. Torch only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .layout import position_dims
from .transposed_linear import TransposedLinear, layer_kind

__all__ = ["COMBINABLE", "combinable", "concatenate_calls"]

#: Layer types whose calls combine by concatenating positions (keys: :func:`~.transposed_linear.layer_kind`).
COMBINABLE = frozenset({nn.Linear, TransposedLinear, nn.Embedding, nn.LayerNorm, nn.RMSNorm, nn.PReLU})


def combinable(module: nn.Module) -> bool:
    """Whether several calls of ``module`` in one pass can be measured as one (module docstring)."""
    return layer_kind(module) in COMBINABLE


def concatenate_calls(module: nn.Module, calls: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """One ``(input, output gradient)`` for the calls ``(input, output gradient)``, batch first: each reshaped to
    ``(B, positions, *features)`` and concatenated along the positions. A single call is returned as it is."""
    if len(calls) == 1:
        return calls[0]
    if isinstance(module, nn.PReLU):  # channels first, every element on its own
        return tuple(torch.cat([t.reshape(t.shape[0], module.num_parameters, -1) for t in part], 2)
                     for part in zip(*calls))
    inputs, grads = [], []
    for inp, grad in calls:
        leading = position_dims(module, inp)
        inputs.append(inp.reshape(inp.shape[0], -1, *inp.shape[leading:]))
        grads.append(grad.reshape(grad.shape[0], -1, *grad.shape[leading:]))
    return torch.cat(inputs, 1), torch.cat(grads, 1)
