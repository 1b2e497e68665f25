"""What lies between a bare parameter and the op that reads its per-example gradients (:mod:`.broadcast`,
:mod:`.matmul`): transposes and autocast's cast before a matrix product, slices and reshapes before a broadcast
(minGPT's ``x + self.pos_emb[:, :T]``, ``self.table[None]``, ``x * self.gamma.view(1, -1, 1, 1)``), permutations
of three or more dims, and a table's lookup on indices that are not the examples' (nanoGPT's
``self.wpe(torch.arange(T))``, T5's relative-position buckets, Swin's ``table[relative_position_index]``).

None of these involves the examples, so each example's gradient of the parameter is the op's backward applied to
that example's gradient of the op's output: a slice's places it in its window of zeros, a select's in its row, a
reshape's reshapes it, a permutation's permutes it back, a lookup's adds each position's into its row
(:func:`back_through`). Torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

__all__ = ["CASTS", "LOOKUPS", "PERMUTES", "RESHAPES", "SLICES", "TRANSPOSES", "VIEWS", "ParameterPath", "back_through",
           "is_parameter", "lookup_indices", "parameter_behind", "shape_after", "shape_taken", "signed"]

#: Nodes that transpose a 2-D parameter (before a matrix product): the norm does not see them.
TRANSPOSES = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0"})

#: The cast autocast puts before a matrix product (bf16/fp16 mixed precision): it changes only the precision; and a
#: copy (``.contiguous()`` after a permutation, Swin's relative-position bias), which changes nothing.
CASTS = frozenset({"ToCopyBackward0", "CloneBackward0"})

#: Nodes that take a window or a row of a parameter.
SLICES = frozenset({"SliceBackward0", "SelectBackward0"})

#: A table's lookup (``F.embedding``, or ``table[indices]`` along dim 0): rows of the parameter picked by indices it
#: saved. Read only where those indices hold no examples: the tracker hands an embedding on here only where they
#: have no batch dim (:func:`~.embedding.shared_table_reason`), and a bare table's lookup is read only between it and
#: a broadcast over the batch (Swin's ``table[relative_position_index]``); the sum check catches any other use.
LOOKUPS = frozenset({"EmbeddingBackward0", "IndexBackward0"})

#: A permutation of three or more dims: a view whose layout changes (a 2-D permutation is a transpose).
PERMUTES = frozenset({"PermuteBackward0"})

#: Nodes that only reshape a parameter (its elements in the same order).
RESHAPES = frozenset({"UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ViewBackward0",
                      "ReshapeAliasBackward0", "UnsafeViewBackward0"})

#: Of those, the views proper: their output shape is not saved, and is read from the node's record of the gradient
#: it takes (:func:`shape_taken`; a parameter behind one is not read where torch keeps no such record). The same
#: nodes view a matrix product's rows back to its input's shape (:mod:`.matmul`).
VIEWS = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"})


@dataclass(frozen=True)
class ParameterPath:
    """A parameter reached through ``views`` (slices and reshapes, outermost first), ``transposed`` or not:
    ``view_inputs`` holds each view's input shape (outermost first), ``shape`` what the consuming op takes;
    ``negated`` where it was taken as ``−P`` or ``1 − P`` (RWKV's ``x·μ + x_prev·(1 − μ)``), whose gradient is minus
    the use's."""

    param: Tensor
    transposed: bool
    views: tuple[Any, ...]
    view_inputs: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    negated: bool = False


def parameter_behind(node: Any, params: dict[int, Tensor]) -> Optional[ParameterPath]:
    """The parameter among ``params`` (by ``id``) that ``node`` hands on through transposes, casts, slices and
    reshapes alone (each node with that one input); None if ``node`` leads to anything else, or through a view
    whose output shape is not recorded."""
    transposed, negated, views = False, False, []
    while node is not None and (shifted := _shift_source(node)) is not None:
        node = shifted
    while node is not None and len(node.next_functions) == 1:
        kind = type(node).__name__
        if kind in SLICES | RESHAPES or _is_lookup(node) or (kind in PERMUTES and len(node._saved_dims) > 2):
            views.append(node)
        elif kind in TRANSPOSES:
            transposed ^= _swaps(node)
        elif _negates(node):
            negated = not negated
        elif kind not in CASTS:
            return None
        node = node.next_functions[0][0]
    variable = getattr(node, "variable", None)
    if variable is None or id(variable) not in params:
        return None
    shape, inputs = tuple(variable.shape), []
    for view in reversed(views):  # from the parameter up
        inputs.append(shape)
        shape = shape_after(view, shape)
        if shape is None:
            return None
    return ParameterPath(params[id(variable)], transposed, tuple(views), tuple(reversed(inputs)), shape, negated)


def _negates(node: Any) -> bool:
    """``−P``, or ``c − P`` with ``c`` a number (``torch.rsub``'s ``alpha`` 1): the gradient passes with its sign
    turned."""
    kind = type(node).__name__
    return kind == "NegBackward0" or (kind == "RsubBackward1" and float(getattr(node, "_saved_alpha", 1)) == 1)


def _shift_source(node: Any) -> Optional[Any]:
    """What ``node`` shifts, where it is ``P + c`` with ``P`` a parameter (maybe cast) and ``c`` a constant that
    does not change its shape (Gemma's RMSNorm scales by ``1 + weight``): ``P``'s gradient is the sum's, so the
    shift is passed over. None for any other node."""
    inputs = node.next_functions
    if type(node).__name__ != "AddBackward0" or len(inputs) != 2 or inputs[0][0] is None or inputs[1][0] is not None:
        return None
    source = inputs[0][0]
    leaf = source.next_functions[0][0] if type(source).__name__ in CASTS and len(source.next_functions) == 1 else source
    variable = getattr(leaf, "variable", None)
    return source if variable is not None and shape_taken(node) == tuple(variable.shape) else None


def _is_lookup(node: Any) -> bool:
    """A lookup read here: an embedding without ``scale_grad_by_freq``, or one index tensor along dim 0."""
    kind = type(node).__name__
    if kind == "EmbeddingBackward0":
        return not node._saved_scale_grad_by_freq
    if kind == "IndexBackward0":
        indices = node._saved_indices
        return len(indices) == 1 and indices[0] is not None and indices[0].dtype != torch.bool
    return False


def lookup_indices(node: Any) -> Tensor:
    """The indices a lookup node (:data:`LOOKUPS`) saved."""
    return node._saved_indices[0] if type(node).__name__ == "IndexBackward0" else node._saved_indices


def _permutation(node: Any, dims: int) -> list[int]:
    """A permute node's dims, each in ``0..dims-1``."""
    return [signed(d) % dims for d in node._saved_dims]


def signed(value: Any) -> int:
    """A dim, index or slice bound a node saved, as Python reads it: torch saves a negative one (``unsqueeze(-1)``,
    ``table[-1]``, ``table[-2:]``) as its unsigned 64-bit value, 2**64 − |value|. A slice's open end is saved as
    2**63 − 1, which is kept."""
    value = int(value)
    return value - 2**64 if value >= 2**63 else value


def _dim(node: Any, dims: int) -> int:
    """The dim a slice, select, unsqueeze or squeeze node saved, in ``0..dims-1``."""
    return signed(node._saved_dim) % dims


def _window(node: Any, size: int) -> slice:
    """The window a slice node took of a dim of ``size``."""
    return slice(*slice(signed(node._saved_start), signed(node._saved_end), signed(node._saved_step)).indices(size))


def shape_taken(node: Any, output: int = 0) -> Optional[tuple[int, ...]]:
    """The shape of the gradient ``node`` takes for its forward output ``output`` (that output's shape), from torch's
    record of it (a private attribute, so None where a torch version lacks it)."""
    try:
        return tuple(int(n) for n in node._input_metadata[output].shape)
    except (AttributeError, IndexError, TypeError):
        return None


def _swaps(node: Any) -> bool:
    """Whether a transpose node of a 2-D tensor swaps its dims (``permute(0, 1)`` and ``transpose(0, 0)`` do not).
    Dims are read mod 2: a negative dim is saved as its unsigned 64-bit value, whose parity is the same."""
    kind = type(node).__name__
    if kind == "PermuteBackward0":
        return tuple(int(d) % 2 for d in node._saved_dims) == (1, 0)
    if kind == "TransposeBackward0":
        return int(node._saved_dim0) % 2 != int(node._saved_dim1) % 2
    return True  # TBackward0


def shape_after(node: Any, shape: tuple[int, ...]) -> Optional[tuple[int, ...]]:
    """The shape of the output of the view ``node`` (:data:`SLICES`, :data:`RESHAPES`) of a tensor of ``shape``;
    None for a view whose output shape is not recorded."""
    kind = type(node).__name__
    if kind in LOOKUPS:
        return tuple(lookup_indices(node).shape) + shape[1:]
    if kind in PERMUTES:
        return tuple(shape[d] for d in _permutation(node, len(shape)))
    if kind == "SliceBackward0":
        dim = _dim(node, len(shape))
        window = range(shape[dim])[_window(node, shape[dim])]
        return shape[:dim] + (len(window),) + shape[dim + 1:]
    if kind == "SelectBackward0":
        dim = _dim(node, len(shape))
        return shape[:dim] + shape[dim + 1:]
    if kind == "UnsqueezeBackward0":
        dim = _dim(node, len(shape) + 1)
        return shape[:dim] + (1,) + shape[dim:]
    if kind in VIEWS:
        return shape_taken(node)
    if kind == "SqueezeBackward0":
        return tuple(n for n in shape if n != 1)
    dim = _dim(node, len(shape))  # SqueezeBackward1: one dim
    return shape[:dim] + shape[dim + 1:] if shape[dim] == 1 else shape


def back_through(path: ParameterPath, grads: Tensor) -> Tensor:
    """Per-example gradients ``grads`` (B, *``path.shape``) carried back through the path's views to its parameter:
    (B, *its shape)."""
    for node, in_shape in zip(path.views, path.view_inputs):
        grads = _back(node, in_shape, grads)
    return grads


def _back(node: Any, in_shape: tuple[int, ...], grads: Tensor) -> Tensor:
    """One view's backward, batched over the examples in dim 0."""
    kind, examples = type(node).__name__, grads.shape[0]
    if kind in LOOKUPS:
        return _back_lookup(node, in_shape, grads)
    if kind in PERMUTES:
        dims = _permutation(node, len(in_shape))
        return grads.permute(0, *(1 + dims.index(d) for d in range(len(dims))))
    if kind not in SLICES:
        return grads.reshape(examples, *in_shape)
    full = grads.new_zeros(examples, *in_shape)
    dim = _dim(node, len(in_shape))
    if kind == "SelectBackward0":
        full.select(dim + 1, signed(node._saved_index)).copy_(grads)
    else:
        full[(slice(None),) * (dim + 1) + (_window(node, in_shape[dim]),)] = grads
    return full


def _back_lookup(node: Any, in_shape: tuple[int, ...], grads: Tensor) -> Tensor:
    """A lookup's backward, batched over the examples: each position's gradient added into its index's row of a
    table of zeros, the ``padding_idx`` row left at zero (it takes no gradient)."""
    indices = lookup_indices(node).reshape(-1)
    indices = torch.where(indices < 0, indices + in_shape[0], indices)  # table[-1] is its last row
    rows = grads.reshape(grads.shape[0], indices.numel(), *in_shape[1:])
    padding = int(getattr(node, "_saved_padding_idx", -1))
    if 0 <= padding < in_shape[0]:
        rows = rows.masked_fill((indices == padding).reshape(1, -1, *([1] * (len(in_shape) - 1))), 0)
    return grads.new_zeros(grads.shape[0], *in_shape).index_add_(1, indices.to(grads.device), rows)


def is_parameter(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (a row block, a transpose), not broadcast over a batch:
    ``latents.expand(B, ...)`` (learned queries) gives every example the table, and each example its own rows."""
    if isinstance(tensor, nn.Parameter):
        return True
    return isinstance(tensor._base, nn.Parameter) and tensor.dim() > 0 and tensor.stride(0) != 0

