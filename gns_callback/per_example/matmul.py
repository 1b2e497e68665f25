"""Per-example gradients of a bare parameter used as a matrix product's weight: ``x @ W``, ``x @ W.T``,
``F.linear(x, W, b)`` written in a module's own ``forward``.

``torch.matmul`` and ``F.linear`` fold the examples and positions of ``x`` (B, *, K) into the rows of one matrix
product ``C = α·a W (+ β·b)`` with ``a`` (n, K), ``n = B·T``. ``W``'s gradient is ``α·aᵀδ``, ``δ`` (n, L) the
product's output gradient, so example ``i``'s is ``α·Σ_{t} a_{i,t}ᵀ δ_{i,t}`` over its rows (Goodfellow 2015; the
same sum :mod:`.linear` reads at a module's input), transposed for ``W.T``; ``b``'s is ``β·Σ_t δ_{i,t}``.

Which rows belong to which example is read from the shape the rows are folded from: the product's output is
viewed back to (B, *, L) by the node above it, whose output gradient has that shape (:func:`row_shape`); the
examples' dim of it is told by :func:`~.layout.batch_dim`, as for a layer's input, and nothing is guessed. A
weight taken as the left factor of a 2-D product (``W @ x.T``; ``W @ xᵀ`` on 3-D ``x`` torch folds as ``x @ Wᵀ``,
which is read) or through ``einsum`` is not read; ``bmm`` with ``W.expand(B, ...)`` is read at the expand
(:mod:`.broadcast`).

A weight's per-example gradients are kept as their two factors (:class:`Factors`), and their norms taken as a
layer's are (:func:`~.linear.linear_part_sq_norms`: ``|a_i|²·|δ_i|²`` for one row per example, else the Gram form,
the materialised product or a sketch, whichever is cheaper). They are materialised, (B, numel) in float32, only
where the parameter is also used at a broadcast, to add up with its gradients there; above
:data:`MAX_ROWS_ELEMENTS` it is then left out instead. Torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .layout import LayoutError, batch_dim
from .linear import linear_part_sq_norms
from .param_path import is_parameter

__all__ = ["ADDMM_BIAS_INDEX", "MATRIX_PRODUCTS", "MAX_ROWS_ELEMENTS", "Factors", "bias_example_grads", "is_bias",
           "computed_from_parameters", "product_shape", "row_shape", "rows_are_parameter", "rows_batch_dim",
           "weight_factors"]

#: Matrix-product nodes, their saved left factor, and the input index of their right factor (the weight).
MATRIX_PRODUCTS: dict[str, tuple[str, int]] = {"MmBackward0": ("_saved_self", 1),
                                               "AddmmBackward0": ("_saved_mat1", 2)}

#: Input index of ``addmm``'s added term (a bias ``b`` broadcast over the rows).
ADDMM_BIAS_INDEX = 0

#: The most per-example gradient elements (examples × parameter elements) materialised for one parameter:
#: 128 MiB in float32.
MAX_ROWS_ELEMENTS = 2**25


def _left(node: Any) -> Tensor:
    """The product ``node``'s saved left factor ``a`` (n, K)."""
    return getattr(node, MATRIX_PRODUCTS[type(node).__name__][0])


def product_shape(node: Any) -> tuple[int, int]:
    """(n, L): the rows and width of the matrix product ``node``'s output."""
    rows = getattr(node, MATRIX_PRODUCTS[type(node).__name__][0] + "_sym_sizes")[0]
    return int(rows), int(node._saved_mat2_sym_sizes[1])


def row_shape(node: Any, grad: Tensor) -> tuple[int, ...]:
    """The (B, *) shape the product ``node``'s rows are folded from, read off the output gradient ``grad`` of the
    node hooked above it; ``(rows,)`` where that node's output is not the rows viewed back (a 2-D product used as it
    is, or viewed some other way, as into heads)."""
    rows, width = product_shape(node)
    if grad.dim() >= 2 and grad.shape[-1] == width and math.prod(grad.shape[:-1]) == rows:
        return tuple(grad.shape[:-1])
    return (rows,)


def rows_are_parameter(node: Any, computed: bool = True) -> bool:
    """Whether the product ``node``'s rows are a parameter's (``self.prototypes @ W``, or, where ``computed``, computed
    from parameters alone: ``2 * self.B @ self.A``, a low-rank adapter merged into a weight), not the examples',
    whose count they may match by chance."""
    left = _left(node)
    return is_parameter(left) or (computed and computed_from_parameters(left))


#: Nodes through which the examples may reach a tensor computed from parameters: a lookup's indices (an operand
#: autograd does not list) or a batch dim put on a parameter's values (``latents.expand(B, ...)``; an expand that
#: only widens dims that can't hold the examples is followed: :func:`_expand_keeps_rows`).
EXAMPLES_MAY_ENTER = frozenset({"EmbeddingBackward0", "EmbeddingBagBackward0", "IndexBackward0",
                                "IndexSelectBackward0", "GatherBackward0", "ExpandBackward0", "RepeatBackward0"})

#: Nodes whose operand outside the graph may be a scalar they saved: :func:`computed_from_parameters` follows them.
SCALAR_OPERAND_NODES = frozenset({"MulBackward0", "DivBackward0"})

#: The most autograd nodes :func:`computed_from_parameters` visits before it answers "not known" (False).
MAX_NODES = 8


def computed_from_parameters(tensor: Tensor) -> bool:
    """Whether ``tensor`` was computed from parameters and scalars alone, so that its rows can't be examples: every
    path of its autograd graph ends at an ``nn.Parameter``, none passes a node of :data:`EXAMPLES_MAY_ENTER` (but an
    expand that makes no rows, as in ``F.normalize(self.prototypes, dim=-1)``), and an operand outside the graph is
    a saved scalar (``2 * B``; a tensor operand, such as the data, is saved with its rows). False where that can't
    be shown within :data:`MAX_NODES` nodes."""
    if tensor.grad_fn is None:
        return False
    stack, seen = [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if len(seen) > MAX_NODES or (name in EXAMPLES_MAY_ENTER and not _expand_keeps_rows(node)):
            return False
        if name == "AccumulateGrad":
            if not isinstance(node.variable, torch.nn.Parameter):
                return False
            continue
        inputs = [next_node for next_node, _ in node.next_functions]
        if None in inputs and not _other_operands_scalar(node):
            return False
        stack.extend(next_node for next_node in inputs if next_node is not None)
    return True


def _expand_keeps_rows(node: Any) -> bool:
    """Whether ``node`` is an expand that leaves the dims that may hold the examples as they were (0, and 1 of a
    3-D or wider tensor, where a sequence-first layout holds them): ``F.normalize``'s norm, ``(N, 1)`` widened back
    to ``(N, D)``, makes no rows, where ``latents.expand(B, L, D)`` makes one per example. Its output's size is the
    gradient it takes in (``_input_metadata``); False where it can't be read or the expand adds dims."""
    if type(node).__name__ != "ExpandBackward0":
        return False
    try:
        before, after = tuple(node._saved_self_sym_sizes), tuple(node._input_metadata[0].shape)
    except (AttributeError, IndexError, RuntimeError):
        return False
    kept = min(2, len(after) - 1)  # dims 0 .. kept-1 may hold the examples; the last dim never does
    return len(before) == len(after) and len(after) >= 2 and before[:kept] == after[:kept]


def _other_operands_scalar(node: Any) -> bool:
    """Whether ``node`` multiplies or divides by a scalar outside the graph (``2 * B``, ``B / 4``); any other node
    with an operand outside it may have taken the data (``x + B``, ``F.linear(x, B)``), and reads False."""
    if type(node).__name__ not in SCALAR_OPERAND_NODES:
        return False
    outside = [getattr(node, name, None) for name in ("_saved_self", "_saved_other")]
    outside = [value for value in outside if isinstance(value, Tensor) and not value.requires_grad]
    return bool(outside) and all(value.numel() <= 1 for value in outside)


def rows_batch_dim(shape: tuple[int, ...], expected: Optional[int], sequence_first: bool) -> Optional[int]:
    """0 or 1: the dim of the rows' shape that holds the examples (:func:`~.layout.batch_dim`); None where it
    can't be told."""
    try:
        return batch_dim(shape, len(shape), expected, sequence_first)
    except LayoutError:
        return None


@dataclass(frozen=True)
class Factors:
    """A weight's per-example gradients at its products, unmultiplied: ``G_i = Σ_t a_{i,t}ᵀ δ_{i,t}`` (``W``; its
    transpose where ``transposed``) with ``left`` (B, positions, K) holding ``α·a`` and ``delta`` (B, positions, L),
    float32, examples first. Several products of one pass (a weight applied at every step of a recurrence) are one
    sum over all their positions (:meth:`joined`), as :mod:`.repeated` reads a layer's calls."""

    left: Tensor
    delta: Tensor
    transposed: bool

    def joined(self, other: Factors) -> Factors:
        """Both products' positions as one (each example's gradient is the sum of both)."""
        if other.transposed != self.transposed:  # Gᵀ's factors, swapped, are G's (a tied autoencoder: x @ W, h @ Wᵀ)
            other = Factors(other.delta, other.left, self.transposed)
        return Factors(torch.cat([self.left, other.left], 1), torch.cat([self.delta, other.delta], 1),
                       self.transposed)

    @property
    def examples(self) -> int:
        return self.left.shape[0]

    def first(self, count: int) -> Factors:
        """The first ``count`` examples' factors."""
        return Factors(self.left[:count], self.delta[:count], self.transposed)

    def sq_norms(self) -> Tensor:
        """``|G_i|²`` (B,), without materialising ``G_i`` where cheaper (:func:`~.linear.linear_part_sq_norms`)."""
        left, delta = (self.left[:, 0], self.delta[:, 0]) if self.left.shape[1] == 1 else (self.left, self.delta)
        return linear_part_sq_norms(left, delta, use_weight=True, use_bias=False)

    def summed(self) -> Tensor:
        """``Σ_i G_i`` flattened in the parameter's layout: the gradient these examples contribute."""
        left, delta = self.left.reshape(-1, self.left.shape[-1]), self.delta.reshape(-1, self.delta.shape[-1])
        return (delta.t() @ left if self.transposed else left.t() @ delta).reshape(-1)

    def rows(self) -> Tensor:
        """(B, numel): each ``G_i`` materialised, to add to the parameter's gradients at other ops."""
        grads = (torch.bmm(self.delta.transpose(1, 2), self.left) if self.transposed
                 else torch.bmm(self.left.transpose(1, 2), self.delta))
        return grads.reshape(self.examples, -1)


def is_bias(kind: str, index: int) -> bool:
    """Whether input ``index`` of a ``kind`` node is ``addmm``'s added term."""
    return index == ADDMM_BIAS_INDEX and kind == "AddmmBackward0"


def bias_example_grads(node: Any, grad: Tensor, dim: int) -> Tensor:
    """(B, L) float32: each example's gradient of the bias ``addmm`` adds to its rows, ``β·Σ_t δ_{i,t}``, from the
    hooked node's output gradient ``grad``, the examples in ``dim`` of the rows' shape."""
    return _rows(node, grad, row_shape(node, grad), dim).sum(dim=1) * float(node._saved_beta)


def weight_factors(node: Any, transposed: bool, grad: Tensor, dim: int) -> Factors:
    """The factors of each example's gradient of the weight of the product ``node`` (module docstring), from the
    hooked node's output gradient ``grad``, the examples in ``dim`` of the rows' shape."""
    shape, left = row_shape(node, grad), _left(node).float()
    left = _examples_first(left.reshape(*shape, left.shape[-1]), dim)
    alpha = float(getattr(node, "_saved_alpha", 1))
    return Factors(left if alpha == 1 else left * alpha, _rows(node, grad, shape, dim), transposed)


def _rows(node: Any, grad: Tensor, shape: tuple[int, ...], dim: int) -> Tensor:
    """The product's output gradient, its rows folded from ``shape``, as (B, positions, L), float32."""
    return _examples_first(grad.float().reshape(*shape, product_shape(node)[1]), dim)


def _examples_first(values: Tensor, dim: int) -> Tensor:
    """``values`` (*rows, features) as (B, positions, features), the examples' dim ``dim`` moved first."""
    return values.movedim(dim, 0).reshape(values.shape[dim], -1, values.shape[-1])
