"""Per-example squared gradient norms for ``nn.MultiheadAttention``, whose projections are applied functionally.

``nn.MultiheadAttention`` (inside every ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer``) never
calls a Linear module: ``F.multi_head_attention_forward`` applies its projections with ``F.linear`` on
``in_proj_weight`` (or on row blocks of it: ``split``/``chunk`` views for cross-attention), on ``q/k/v_proj_weight``
when the key and value widths differ, and on ``out_proj.weight``. A module hook sees none of those calls, so
:class:`ProjectionCalls` reports them: while one such module runs its forward, ``torch.nn.functional.linear`` (the
name those functions look up) is a pass-through wrapper that tells the tracker about each call on one of the
module's parameters, with the input and the output, and returns the very same output. Nothing is recomputed, so
the forward is unchanged to the bit; the wrapper is removed when the forward returns or raises.

Each call is a linear map, so example ``i``'s gradient of the rows it uses is ``Σ_t δ_{i,t} a_{i,t}ᵀ`` (weight) and
``Σ_t δ_{i,t}`` (bias), as for ``nn.Linear`` (:func:`~.linear.linear_part_sq_norms`). Calls on one parameter use
disjoint row blocks (query, key and value rows of ``in_proj_weight``), so the parameter's squared norm is the sum
of the blocks' squared norms. Inside ``F.multi_head_attention_forward`` the examples are in dim 1 of the
``(L, N, E)`` projection inputs and the out-projection's input is ``(L·N, E)`` with the example index fastest; both
read as ``reshape(-1, N, E)``, with ``N`` known from the module's own ``batch_first`` and its query's shape.
Checked against per-example backward passes in ``tests/per_example/test_attention.py``. Torch only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .linear import linear_part_sq_norms
from .subclass import runs_as

__all__ = ["MEASURED_ATTENTION_PARAMS", "ProjectionCall", "ProjectionCalls", "attention_batch_size",
           "attention_query", "is_attention", "projection_sq_norms"]

#: The parameters of an ``nn.MultiheadAttention`` measured (``bias_k``/``bias_v`` of ``add_bias_kv=True`` are not:
#: they are concatenated to the keys and values, not projected).
MEASURED_ATTENTION_PARAMS = frozenset({"in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                                       "v_proj_weight", "out_proj.weight", "out_proj.bias"})


def is_attention(module: nn.Module) -> bool:
    """Whether ``module`` runs as ``nn.MultiheadAttention`` (:func:`~.subclass.runs_as`)."""
    return runs_as(type(module)) is nn.MultiheadAttention


def attention_batch_size(module: nn.Module, query: Any) -> Optional[int]:
    """Examples in a batched ``query`` of ``module`` (``(N, L, E)`` if ``batch_first`` else ``(L, N, E)``); None for
    an unbatched ``(L, E)`` query or anything else."""
    if not isinstance(query, Tensor) or query.dim() != 3:
        return None
    return int(query.shape[0] if module.batch_first else query.shape[1])


@dataclass(frozen=True)
class ProjectionCall:
    """One ``F.linear`` on an attention module's parameters: which parameter (local name) and first row the weight
    and the bias are, or None where the call has none of the module's."""

    weight: Optional[tuple[str, int]]
    bias: Optional[tuple[str, int]]

    def keys(self) -> list[tuple[str, int]]:
        return [part for part in (self.weight, self.bias) if part is not None]


def _rows_of(tensor: Optional[Tensor], params: dict[str, Tensor]) -> Optional[tuple[str, int]]:
    """``(local name, first row)`` of the parameter whose row block ``tensor`` is (itself, or a ``split``/``chunk``
    view of it), else None."""
    if tensor is None:
        return None
    for name, param in params.items():
        if tensor is param:
            return name, 0
        if tensor._base is param and tensor.stride() == param.stride() and tensor.shape[1:] == param.shape[1:]:
            offset = tensor.storage_offset() - param.storage_offset()
            if offset % param.stride(0) == 0:
                return name, offset // param.stride(0)
    return None


class ProjectionCalls:
    """While entered, every ``F.linear`` on the parameters ``param_names`` of ``module`` (local names, e.g.
    ``"out_proj.weight"``: those the tracker covers, so that a parameter it left out, e.g. one shared with another
    module, never reaches the norms) goes to ``on_call(call, input, output)`` after it ran (module docstring). Enter
    it around one forward of the module only."""

    def __init__(self, module: nn.Module, param_names: Collection[str],
                 on_call: Callable[[ProjectionCall, Tensor, Tensor], None]) -> None:
        self.params = {name: module.get_parameter(name) for name in param_names}
        self.on_call = on_call
        self._original: Optional[Callable[..., Tensor]] = None
        self._wrapper = self._linear  # one bound method, so that `F.linear is self._wrapper` can tell it is ours

    def __enter__(self) -> ProjectionCalls:
        self._original = F.linear
        F.linear = self._wrapper
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if F.linear is self._wrapper:  # else someone patched it after us: leave theirs in place
            F.linear = self._original

    def _linear(self, input: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        output = self._original(input, weight, bias)
        call = ProjectionCall(_rows_of(weight, self.params), _rows_of(bias, self.params))
        if call.keys():
            self.on_call(call, input, output)
        return output


def projection_sq_norms(call: ProjectionCall, inp: Tensor, grad_output: Tensor, batch: int) -> Tensor:
    """Per-example squared norm ``(N,)`` of the gradient one projection call gives its rows: the input and output
    gradient are read as ``(L, N, ·)`` (:func:`~.linear.linear_part_sq_norms` on them, batch first)."""
    if inp.numel() % (batch * inp.shape[-1]) or grad_output.numel() % (batch * grad_output.shape[-1]):
        raise ValueError(f"a projection's input of shape {tuple(inp.shape)} does not hold {batch} examples")
    activations = inp.reshape(-1, batch, inp.shape[-1]).transpose(0, 1)
    grads = grad_output.reshape(-1, batch, grad_output.shape[-1]).transpose(0, 1)
    return linear_part_sq_norms(activations, grads, call.weight is not None, call.bias is not None)


def attention_query(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The ``query`` argument of an ``nn.MultiheadAttention`` forward."""
    return args[0] if args else kwargs.get("query")
