"""Hugging Face ``transformers``' ``Conv1D`` (GPT, GPT-2): a Linear layer whose weight is stored transposed.

``y = x @ W + b`` with ``W`` of shape ``(nx, nf)`` (``nn.Linear`` keeps ``(out, in)``). Example ``i``'s weight
gradient is ``Σ_t a_tᵀ δ_t``, the transpose of a Linear's, so its squared norm is the Linear's
(:func:`~.linear.linear_sq_norms` reads only the input and output gradient); the summed gradient of a subset is the
Linear's, transposed. The layer is recognised by its shape contract (class name ``Conv1D``, ``nf``/``nx``, a
``(nx, nf)`` weight, an ``(nf,)`` bias), without importing ``transformers``.

:func:`layer_kind` is the key every per-layer table is looked up with: the module's type, or
:class:`TransposedLinear` for such a layer.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import Tensor, nn

from .linear import linear_summed_grads
from .subclass import runs_as
from .weight_norm import plain_type

__all__ = ["TransposedLinear", "is_transposed_linear", "layer_kind", "transposed_linear_summed_grads"]


class TransposedLinear:
    """The table key of a ``transformers`` ``Conv1D`` (a marker: never instantiated)."""


def is_transposed_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a ``Conv1D`` of ``transformers``: ``y = x @ weight + bias``, weight ``(nx, nf)``."""
    if type(module).__name__ != "Conv1D":
        return False
    nf, nx, weight = getattr(module, "nf", None), getattr(module, "nx", None), getattr(module, "weight", None)
    bias = getattr(module, "bias", None)
    return (isinstance(nf, int) and isinstance(nx, int) and isinstance(weight, Tensor)
            and tuple(weight.shape) == (nx, nf) and (bias is None or tuple(bias.shape) == (nf,)))


def layer_kind(module: nn.Module) -> type:
    """The key of ``module`` in the per-layer tables: :class:`TransposedLinear`, or its type (for a
    weight-normalised layer the class it parametrizes, :func:`~.weight_norm.plain_type`), read as the ``torch.nn``
    layer it runs as where it only changes how that layer is built (:func:`~.subclass.runs_as`)."""
    return TransposedLinear if is_transposed_linear(module) else runs_as(plain_type(module))


def transposed_linear_summed_grads(module: nn.Module, inp: Tensor, grad_output: Tensor, *,
                                   param_names: Collection[str] | None = None) -> dict[str, Tensor]:
    """:func:`~.linear.linear_summed_grads` with the weight's gradient transposed to ``(nx, nf)``."""
    summed = linear_summed_grads(module, inp, grad_output, param_names=param_names)
    if "weight" in summed:
        summed["weight"] = summed["weight"].t()
    return summed
