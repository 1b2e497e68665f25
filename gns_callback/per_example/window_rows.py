"""Rows that each hold a part of one example, example by example: Swin's windows, ``(B·nW, T, C)``.

Swin's attention cuts each example's feature map into ``nW`` windows and stacks them as rows:
``x.view(B, h, w, w_, w, C).permute(0, 1, 3, 2, 4, 5).reshape(B·nW, w·w, C)``. A Linear on those rows sees no batch of
``B`` in any dim. Row ``r`` belongs to example ``r // nW`` when the rows are *example-major*: every example's
elements lie together, in one block of the tensor's row-major order, in example order. Then the rows read at shape
``(B, nW, T, C)`` are each example's own (:func:`example_major_rows`).

That is proven, not assumed, by walking back through the autograd graph from the layer's input to tensors whose dim
0 holds the ``B`` examples, through steps that keep the property:

* a view or reshape (the same row-major order);
* an op that maps each index of dim 0 to the same index and leaves that dim alone: a copy, an elementwise activation,
  dropout, a softmax or layer norm over later dims, a transpose or permutation of later dims, an expand of later dims,
  a Linear (``addmm``, ``mm`` by a parameter), a batched matrix product (``bmm``, both factors walked), a fused
  ``scaled_dot_product_attention`` (``q``, ``k`` and ``v`` walked);
* a sum or product with a tensor of the same rows (walked too), a constant, or a parameter broadcast over the rows
  (a relative-position bias: the parameter's slices, lookups and views alone).

On the way the rows may leave dim 0 and come back: timm's attention computes ``q, k, v`` as
``qkv(x).reshape(B·nW, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)``, which puts the rows at dim 1 and then
picks along dim 0. The walk follows the dim that holds the rows through permutations, transposes, picks (``unbind``,
``x[i]``), elementwise ops, and views that leave every dim up to it as it is; a view that merges dims, a Linear and
a batched matrix product must find the rows at dim 0.

Anything else on the way (a reduction over the rows, a concatenation, an op not listed) ends the walk, and the layer
is refused as before. Only in a batch-first model: where a module is sequence-first, dim 0 of size ``B`` might be
positions. Torch only.
"""

from __future__ import annotations

from typing import Any, Optional

from .param_path import CASTS, LOOKUPS, RESHAPES, SLICES, TRANSPOSES, VIEWS, shape_taken, signed

__all__ = ["ACTIVATIONS", "example_major_rows"]

#: Elementwise activations and dropout: each output element is its one input's element's function.
ACTIVATIONS = frozenset({"TanhBackward0", "ReluBackward0", "GeluBackward0", "SigmoidBackward0", "SiluBackward0",
                         "LeakyReluBackward0", "EluBackward0", "HardtanhBackward0", "SoftplusBackward0",
                         "MishBackward0", "HardswishBackward0", "NativeDropoutBackward0"})

#: Ops whose output's dim 0 is their first input's, index for index, and whose other dims are their own concern.
_SAME_ROWS = frozenset({*ACTIVATIONS, "CloneBackward0", "ToCopyBackward0", "NegBackward0", "MulBackward1",
                        "DivBackward1", "AddBackward1", "SubBackward1", "RsubBackward1"})

#: Elementwise ops of two tensors, each broadcast to the output's shape.
_BINARY = frozenset({"AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0"})

#: Ops a broadcast parameter may pass through (its slices, lookups, reshapes, transposes, copies, casts and
#: expands: :mod:`.param_path`'s steps).
_PARAMETER_STEPS = frozenset({*RESHAPES, *SLICES, *LOOKUPS, *TRANSPOSES, *CASTS, "ExpandBackward0"})

#: ``F.scaled_dot_product_attention``'s fused kernels: inputs ``q, k, v`` (then an attention bias, where it takes
#: one), batched over every dim but the last two. (Its math fallback is the ops above.)
_ATTENTION = frozenset({"ScaledDotProductFlashAttentionForCpuBackward0", "ScaledDotProductFlashAttentionBackward0",
                        "ScaledDotProductEfficientAttentionBackward0", "ScaledDotProductCudnnAttentionBackward0"})

#: Nodes visited at most per layer call (a Swin block's attention output takes about 40).
_BUDGET = 200


def example_major_rows(node: Any, shape: tuple[int, ...], examples: int) -> bool:
    """Whether a tensor of ``shape`` made by ``node`` holds its ``examples`` example-major along dim 0 (module
    docstring): ``shape[0]`` a multiple of ``examples``, shown by the walk back to tensors whose dim 0 holds them."""
    if not shape or shape[0] % examples or shape[0] == examples:
        return False
    return _Walk(examples).proves(node, shape)


class _Walk:
    """The walk back from one layer's input; ``dim``: the dim of a node's output that holds the rows."""

    def __init__(self, examples: int) -> None:
        self.examples, self.left, self.proven = examples, _BUDGET, set[tuple[int, tuple[int, ...], int]]()

    def proves(self, node: Any, shape: tuple[int, ...], dim: int = 0) -> bool:
        """``node``'s output of ``shape`` holds its rows example-major along ``dim``."""
        if node is None or not 0 <= dim < len(shape) or shape[dim] % self.examples:
            return False
        key = (id(node), shape, dim)
        if key in self.proven:
            return True
        self.left -= 1
        if self.left < 0:
            return False
        kind = type(node).__name__
        if kind in _MOVES:  # the rows' dim followed to where the op took it from, whatever its size
            found = self._input(node, 0, _MOVES[kind](node, shape, dim))
        elif shape[dim] == self.examples:
            found = self._at_examples(node, kind, dim)
        else:
            found = self._step(node, kind, shape, dim)
        if found:
            self.proven.add(key)
        return found

    def _at_examples(self, node: Any, kind: str, dim: int) -> bool:
        """A dim of ``B``: the examples where it is dim 0 of a tensor the model made there, not a parameter. Where an
        op moved it there from another dim (windows stacked window by window, ``nW = B``), :meth:`proves` follows
        that dim, also through the copies and elementwise ops followed here."""
        if kind in _SAME_ROWS:
            return self._input(node, 0, dim)
        return dim == 0 and not hasattr(node, "variable")

    def _step(self, node: Any, kind: str, shape: tuple[int, ...], dim: int) -> bool:
        if kind in VIEWS:
            return self._through_view(node, shape, dim)
        if kind in _SAME_ROWS or kind in _ROWS_KEPT:
            return _ROWS_KEPT.get(kind, _always)(node, shape, dim) and self._input(node, 0, dim)
        if kind in _BINARY:
            return all(self._operand(node, index, shape, dim) for index in range(len(node.next_functions)))
        if kind in _ATTENTION:
            return self._attention(node, shape, dim)
        if dim != 0:
            return False
        if kind == "AddmmBackward0":
            return _is_parameter(_edge(node, 2)) and self._input(node, 1)
        if kind == "MmBackward0":
            return _is_parameter(_edge(node, 1)) and self._input(node, 0)
        if kind == "BmmBackward0":
            return self._input(node, 0) and self._input(node, 1)
        return False

    def _attention(self, node: Any, shape: tuple[int, ...], dim: int) -> bool:
        """A fused attention: the rows at a batch dim of ``q``, ``k`` and ``v`` alike; a bias, like an operand."""
        inputs = range(len(node.next_functions))
        return (dim < len(shape) - 2 and all(self._input(node, index, dim) for index in inputs[:3])
                and all(self._operand(node, index, shape, dim) for index in inputs[3:]))

    def _through_view(self, node: Any, shape: tuple[int, ...], dim: int) -> bool:
        """A view keeps the row-major order: rows at dim 0 stay example-major blocks; rows at a later dim stay where
        they are if every dim up to theirs is unchanged."""
        edge = _edge(node, 0)
        source = _shape(edge)
        if source is None:
            return False
        if dim == 0:
            return self.proves(edge[0], source)
        return source[: dim + 1] == shape[: dim + 1] and self.proves(edge[0], source, dim)

    def _input(self, node: Any, index: int, dim: int = 0) -> bool:
        edge = _edge(node, index)
        source = _shape(edge)
        return source is not None and self.proves(edge[0], source, dim)

    def _operand(self, node: Any, index: int, shape: tuple[int, ...], dim: int) -> bool:
        """An operand of an elementwise op: a constant, a parameter broadcast over the rows, or rows of its own."""
        edge = node.next_functions[index]
        if edge[0] is None:
            return True
        source = _shape(edge)
        if source is None or len(source) > len(shape):
            return False
        aligned = dim - (len(shape) - len(source))  # the operand's dim broadcast along the rows
        if aligned < 0 or source[aligned] == 1:
            return _is_parameter(edge)
        return self.proves(edge[0], source, aligned)


def _always(_node: Any, _shape: tuple[int, ...], _dim: int) -> bool:
    return True


def _softmax_keeps_rows(node: Any, shape: tuple[int, ...], dim: int) -> bool:
    return signed(node._saved_dim) % len(shape) != dim


def _expand_keeps_rows(node: Any, shape: tuple[int, ...], dim: int) -> bool:
    source = tuple(int(n) for n in node._saved_self_sym_sizes)
    return len(source) == len(shape) and source[dim] == shape[dim]


def _layer_norm_keeps_rows(node: Any, shape: tuple[int, ...], dim: int) -> bool:
    return dim < len(shape) - len(node._saved_normalized_shape)


#: Ops that keep the rows' dim only under a condition on their arguments.
_ROWS_KEPT = {"SoftmaxBackward0": _softmax_keeps_rows, "SafeSoftmaxBackward0": _softmax_keeps_rows,
              "ExpandBackward0": _expand_keeps_rows, "NativeLayerNormBackward0": _layer_norm_keeps_rows}


def _permuted_from(node: Any, shape: tuple[int, ...], dim: int) -> int:
    """Output dim ``j`` of a permutation is its input's ``dims[j]``."""
    return signed(node._saved_dims[dim]) % len(shape)


def _transposed_from(node: Any, shape: tuple[int, ...], dim: int) -> int:
    a, b = (signed(d) % len(shape) for d in (node._saved_dim0, node._saved_dim1))
    return b if dim == a else a if dim == b else dim


def _picked_from(node: Any, shape: tuple[int, ...], dim: int) -> int:
    """``unbind(s)`` and ``x.select(s, i)`` drop input dim ``s``: output dim ``d`` is the input's ``d + (s ≤ d)``."""
    picked = signed(node._saved_dim) % (len(shape) + 1)
    return dim + 1 if picked <= dim else dim


#: Ops that keep every element's row and move the rows' dim: the input dim that holds the output's rows.
_MOVES = {"PermuteBackward0": _permuted_from, "TransposeBackward0": _transposed_from,
          "UnbindBackward0": _picked_from, "SelectBackward0": _picked_from}


def _edge(node: Any, index: int) -> tuple[Any, int]:
    return node.next_functions[index] if index < len(node.next_functions) else (None, 0)


def _shape(edge: tuple[Any, int]) -> Optional[tuple[int, ...]]:
    """The shape of the tensor along a graph edge: the output of its node that the edge takes."""
    return None if edge[0] is None else shape_taken(*edge)


def _is_parameter(edge: tuple[Any, int]) -> bool:
    """A parameter, through its slices, lookups, views, copies and casts alone (nothing of the examples)."""
    node = edge[0]
    for _ in range(_BUDGET):
        if node is None:
            return False
        if hasattr(node, "variable"):
            return True
        if type(node).__name__ not in _PARAMETER_STEPS or len(node.next_functions) < 1:
            return False
        inputs = [edge for edge in node.next_functions if edge[0] is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0][0]
    return False
