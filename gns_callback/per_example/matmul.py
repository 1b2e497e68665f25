"""Per-example gradients of a bare parameter used as a matrix product's weight: ``x @ W``, ``x @ W.T``,
``F.linear(x, W, b)`` written in a module's own ``forward``.

``torch.matmul`` and ``F.linear`` fold the examples and positions of ``x`` (B, *, K) into the rows of one matrix
product ``C = α·a W (+ β·b)`` with ``a`` (n, K), ``n = B·T``. ``W``'s gradient is ``α·aᵀδ``, ``δ`` (n, L) the
product's output gradient, so example ``i``'s is ``α·Σ_{t} a_{i,t}ᵀ δ_{i,t}`` over its rows (Goodfellow 2015; the
same sum :mod:`.linear` reads at a module's input), transposed for ``W.T``; ``b``'s is ``β·Σ_t δ_{i,t}``.

Which rows belong to which example is read from the shape the rows are folded from: the product's output is
viewed back to (B, *, L) by the node above it, whose output gradient has that shape (:func:`row_shape`); the
examples' dim of it is told by :func:`~.layout.batch_dim`, as for a layer's input, and nothing is guessed. A
weight taken as the left factor (``W @ x``), or through a batched product (``einsum``, ``bmm``), is not read.

The per-example gradients are materialised, (B, numel) in float32, so that they add up with the parameter's other
uses and are checked against its gradient (:func:`~.broadcast.sums_to`); above :data:`MAX_ROWS_ELEMENTS` the
parameter is left out instead. Torch only.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from .layout import LayoutError, batch_dim

__all__ = ["ADDMM_BIAS_INDEX", "CASTS", "MATRIX_PRODUCTS", "MAX_ROWS_ELEMENTS", "PASS_THROUGH", "VIEWS", "matmul_example_grads",
           "parameter_behind", "product_shape", "row_shape", "rows_batch_dim"]

#: Matrix-product nodes, their saved left factor, and the input index of their right factor (the weight).
MATRIX_PRODUCTS: dict[str, tuple[str, int]] = {"MmBackward0": ("_saved_self", 1),
                                               "AddmmBackward0": ("_saved_mat1", 2)}

#: Input index of ``addmm``'s added term (a bias ``b`` broadcast over the rows).
ADDMM_BIAS_INDEX = 0

#: Nodes between a 2-D parameter and its product that change neither its values nor their norm: transposes.
PASS_THROUGH = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0"})

#: ... and the cast autocast puts there (bf16/fp16 mixed precision), which changes only the precision.
CASTS = frozenset({"ToCopyBackward0"})

#: Nodes that view a product's rows back to the shape of its input (``torch.matmul``, ``F.linear`` on 3-D+ input).
VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})

#: The most per-example gradient elements (examples × parameter elements) materialised for one parameter:
#: 128 MiB in float32.
MAX_ROWS_ELEMENTS = 2**25


def parameter_behind(node: Any, params: dict[int, Tensor]) -> Optional[tuple[Tensor, bool]]:
    """The parameter among ``params`` (by ``id``) that ``node`` passes on unchanged but for transposes and casts,
    and whether it is transposed; None if ``node`` is anything else."""
    transposed = False
    while node is not None and type(node).__name__ in PASS_THROUGH | CASTS and len(node.next_functions) == 1:
        transposed ^= type(node).__name__ in PASS_THROUGH
        node = node.next_functions[0][0]
    variable = getattr(node, "variable", None)
    if variable is None or id(variable) not in params:
        return None
    return params[id(variable)], transposed


def product_shape(node: Any) -> tuple[int, int]:
    """(n, L): the rows and width of the matrix product ``node``'s output."""
    left = node._saved_self_sym_sizes if type(node).__name__ == "MmBackward0" else node._saved_mat1_sym_sizes
    return int(left[0]), int(node._saved_mat2_sym_sizes[1])


def row_shape(node: Any, grad: Tensor) -> tuple[int, ...]:
    """The (B, *) shape the product ``node``'s rows are folded from, read off the output gradient ``grad`` of the
    node hooked above it; ``(rows,)`` where that node's output is not the rows viewed back (a 2-D product used as it
    is, or viewed some other way, as into heads)."""
    rows, width = product_shape(node)
    if grad.dim() >= 2 and grad.shape[-1] == width and math.prod(grad.shape[:-1]) == rows:
        return tuple(grad.shape[:-1])
    return (rows,)


def rows_batch_dim(shape: tuple[int, ...], expected: Optional[int], sequence_first: bool) -> Optional[int]:
    """0 or 1: the dim of the rows' shape that holds the examples (:func:`~.layout.batch_dim`); None where it
    can't be told."""
    try:
        return batch_dim(shape, len(shape), expected, sequence_first)
    except LayoutError:
        return None


def matmul_example_grads(node: Any, index: int, transposed: bool, grad: Tensor, dim: int) -> Tensor:
    """(B, numel) float32: each example's gradient of the parameter at input ``index`` of the product ``node``
    (module docstring), from the gradient ``grad`` of the node's output viewed back to (*rows, L), the examples
    in ``dim`` of the rows' shape."""
    shape, (_, width) = row_shape(node, grad), product_shape(node)
    delta = _examples_first(grad.float().reshape(*shape, width), dim)
    if index == ADDMM_BIAS_INDEX and type(node).__name__ == "AddmmBackward0":
        return delta.sum(dim=1) * float(node._saved_beta)
    attribute, _ = MATRIX_PRODUCTS[type(node).__name__]
    left = getattr(node, attribute).float()
    left = _examples_first(left.reshape(*shape, left.shape[-1]), dim) * float(getattr(node, "_saved_alpha", 1))
    grads = torch.bmm(delta.transpose(1, 2), left) if transposed else torch.bmm(left.transpose(1, 2), delta)
    return grads.reshape(grads.shape[0], -1)


def _examples_first(values: Tensor, dim: int) -> Tensor:
    """``values`` (*rows, features) as (B, positions, features), the examples' dim ``dim`` moved first."""
    return values.movedim(dim, 0).reshape(values.shape[dim], -1, values.shape[-1])
