"""Per-example gradients of a bare parameter broadcast over the batch: a ViT's class token and position table, a
layer-scale vector, a learned offset added to the activations.

Such a parameter ``P`` belongs to no layer this package measures; it enters the graph through one op that
broadcasts it against the examples. The op's output gradient ``δ`` holds each example's part: ``P``'s gradient
is ``δ`` summed over the dims ``P`` was broadcast along, so example ``i``'s is ``δ_i`` summed the same way, times
``α`` for ``x + α·P`` and ``−α`` for ``x − α·P``, and ``δ_i ⊙ x_i`` summed for ``x ⊙ P`` (McCandlish et al. 2018
need only ``|g_i|²``; BackPACK's ``batch_grad`` takes the same reduction for a layer's bias).

The op is found in autograd's graph after each forward (:func:`find_consumers`), as the node whose inputs hold
``P``'s ``AccumulateGrad``, maybe through a slice or reshape of ``P`` (minGPT's ``x + pos_emb[:, :T]``,
:mod:`.param_path`, which carries each example's gradient back to ``P``'s shape); a pre-hook on it hands over ``δ``
(:func:`example_grads`). A weight of a matrix product written out (``x @ W``, ``F.linear(x, W, b)``) is read the
same way, at the product (:mod:`.matmul`). Uses through any other op (a ``view``, a batched product) are not read:
the tracker compares the summed per-example gradients with ``P``'s gradient on the first pass and leaves ``P`` out
where they differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
from torch import Tensor

from .matmul import (MATRIX_PRODUCTS, Factors, bias_example_grads, is_bias, row_shape, rows_are_parameter,
                     rows_batch_dim, weight_factors)
from .bare_lookup import LookupGrads, TiedGrads, lookup_example_grads
from .embedding import shared_table_reason
from .layout import LayoutError
from .layout import batch_dim as layout_batch_dim
from .param_path import LOOKUPS, VIEWS, ParameterPath, back_through, lookup_indices, parameter_behind
from .window_rows import example_major_rows

__all__ = ["CONSUMERS", "Consumer", "ExampleGrads", "Rows", "adds_up_to", "batch_dim", "caller_reads", "example_grads",
           "examples_dim", "find_consumers", "rows_per_example"]

#: The autograd nodes whose output gradient gives a broadcast parameter's per-example gradient.
CONSUMERS = frozenset({"AddBackward0", "SubBackward0", "MulBackward0", "ExpandBackward0"})
#: A layer norm's node, whose weight and bias (inputs 1 and 2: ``F.layer_norm(x, shape, self.weight, self.bias)`` in
#: a module of the model's own, nanoGPT's ``LayerNorm``) are broadcast over its normalised rows.
_LAYER_NORM = "NativeLayerNormBackward0"


@dataclass(frozen=True)
class Consumer:
    """A node of this forward's graph that takes a parameter (reached by ``path``: maybe transposed or a slice of
    it, :mod:`.param_path`) as its input ``index``: a broadcast (:data:`CONSUMERS`) or a matrix product
    (:mod:`.matmul`), whose rows may be viewed back to the examples' shape by the node ``above`` it, hooked
    instead."""

    node: Any  # torch.autograd.graph.Node
    index: int
    path: ParameterPath
    above: Any = None
    #: One of two readings of a table looked up and then broadcast (``x + W[i]``): at the broadcast, where the
    #: indices are positions shared by the examples, or at the lookup, where they hold the examples; each passes
    #: over what the other reads (:func:`examples_dim` gives None).
    dual: bool = False

    @property
    def param(self) -> Tensor:
        return self.path.param

    @property
    def hooked(self) -> Any:
        """The node whose output gradient holds the examples' parts: ``above``, or the consumer itself."""
        return self.node if self.above is None else self.above

    @property
    def is_product(self) -> bool:
        return type(self.node).__name__ in MATRIX_PRODUCTS

    @property
    def is_lookup(self) -> bool:
        """The parameter is a table this node looks up at each example's own indices (:mod:`.bare_lookup`)."""
        return type(self.node).__name__ in LOOKUPS


@dataclass(frozen=True)
class Rows:
    """A bare parameter's per-example gradients materialised: ``values`` (B, numel), float32. The same reads as a
    matrix product's :class:`~.matmul.Factors`, so that the tracker treats both alike."""

    values: Tensor

    @property
    def examples(self) -> int:
        return self.values.shape[0]

    def joined(self, other: Rows) -> Rows:
        """Both uses' gradients, each example's summed (in place)."""
        self.values.add_(other.values)
        return self

    def first(self, count: int) -> Rows:
        """The first ``count`` examples' gradients."""
        return Rows(self.values[:count])

    def sq_norms(self) -> Tensor:
        """``|g_i|²`` (B,)."""
        return self.values.square().sum(dim=1)

    def summed(self) -> Tensor:
        """``Σ_i g_i`` (numel,): the gradient these examples contribute."""
        return self.values.sum(dim=0)

    def rows(self) -> Tensor:
        return self.values


#: A bare parameter's per-example gradients, as read at one of its uses.
ExampleGrads = Union[Rows, Factors, LookupGrads, TiedGrads]


def find_consumers(outputs: Iterable[Tensor], params: Mapping[int, Tensor],
                   stop_at: Iterable[Any] = ()) -> tuple[list[Consumer], dict[int, str]]:
    """The nodes reachable from ``outputs`` that take one of ``params`` (by ``id``) as an input, directly or through
    the views :mod:`.param_path` reads; and per parameter also taken by a node that is not read here, that
    node's name (a use not read here). The walk does not enter the nodes ``stop_at`` (those of the forward's
    inputs, made before it: each layer's walk stays in its layer). An output that is itself a lookup of a table
    (a subclass of ``nn.Embedding`` whose forward returns ``super().forward(positions)``, BART's and OPT's) is
    read at that lookup."""
    found: list[Consumer] = []
    stack: list[Any] = []
    for node in (t.grad_fn for t in outputs if t.grad_fn is not None):
        lookup = _output_lookup(node, params)
        if lookup:
            found += lookup
        else:
            stack.append(node)
    seen: dict[int, Any] = {id(node): node for node in stop_at}  # id → node, held so that no id is reused
    parents: dict[int, list[Any]] = {}
    unread: dict[int, str] = {}
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        kind = type(node).__name__
        for index, (child, _) in enumerate(node.next_functions):
            path = parameter_behind(child, params)
            if path is not None:
                read = _consumers(node, index, path)
                if read:
                    found += read
                else:
                    unread[id(path.param)] = kind if not path.views else type(path.views[0]).__name__
            elif child is not None and getattr(child, "variable", None) is None:
                parents.setdefault(id(child), []).append(node)
                stack.append(child)
    return [_with_view_above(consumer, parents) for consumer in found], unread


def _output_lookup(node: Any, params: Mapping[int, Tensor]) -> list[Consumer]:
    """``[the lookup]`` where ``node``, a forward's output node, looks up one of ``params`` as it is; else ``[]``."""
    path = parameter_behind(node, params)
    return [Consumer(path.views[0], 0, path)] if path is not None and _looked_up(path) else []


def caller_reads(node: Any, params: Mapping[int, Tensor], batch_size: Optional[int],
                 sequence_first: bool = False) -> Optional[ParameterPath]:
    """How a forward's output node hands on one of ``params`` as it is, where only the forward that called it can
    read that parameter: through views alone (Whisper's ``weight[:T]``), or looked up at positions shared by the
    examples (BART's decoder positions); its rows meet the examples at that caller's broadcast. None for any other
    output, and for a lookup at the examples' own indices, read at the lookup (:func:`find_consumers`)."""
    path = parameter_behind(node, params)
    if path is None or path.transposed or path.negated:
        return None
    if _looked_up(path) and _indices_batch_dim(lookup_indices(path.views[0]), batch_size, sequence_first) is not None:
        return None
    return path


def _reads(kind: str, index: int, path: ParameterPath) -> bool:
    """Whether a parameter reached by ``path`` at input ``index`` of a ``kind`` node is read: at a broadcast as it
    is or a slice of it; at a matrix product as its weight, either way round, or (``addmm``) as the bias added to
    its rows."""
    if kind == _LAYER_NORM:
        return index in (1, 2) and not (path.views or path.transposed or path.negated)
    if kind not in MATRIX_PRODUCTS:
        return kind in CONSUMERS and not path.transposed
    if path.views or path.negated:
        return False
    return index == MATRIX_PRODUCTS[kind][1] or (is_bias(kind, index) and not path.transposed)


def _consumers(node: Any, index: int, path: ParameterPath) -> list[Consumer]:
    """Where a use of a parameter is read: at ``node``, at the lookup of a table ``path`` looks up as it is, at
    both (``dual``), or nowhere (``[]``)."""
    at_node = _reads(type(node).__name__, index, path)
    if not _looked_up(path):
        return [Consumer(node, index, path)] if at_node else []
    at_lookup = Consumer(path.views[0], 0, path)
    return [Consumer(node, index, path, dual=True), replace(at_lookup, dual=True)] if at_node else [at_lookup]


def _looked_up(path: ParameterPath) -> bool:
    """A table looked up as it is (``F.embedding(x, W)``, ``W[x]``) by a node not read here: read at the lookup,
    should its indices hold the examples (:func:`examples_dim`)."""
    return (len(path.views) == 1 and type(path.views[0]).__name__ in LOOKUPS and not path.transposed
            and not path.negated)


def _with_view_above(consumer: Consumer, parents: Mapping[int, list[Any]]) -> Consumer:
    """A matrix product whose rows only one view uses is read at that view (:mod:`.matmul`)."""
    above = parents.get(id(consumer.node), [])
    if not consumer.is_product or len(above) != 1 or type(above[0]).__name__ not in VIEWS:
        return consumer
    return replace(consumer, above=above[0])


def examples_dim(consumer: Consumer, grad_output: Tensor, batch_size: Optional[int],
                 sequence_first: bool = False, computed_tables: bool = True) -> Optional[int]:
    """The dim of ``grad_output`` (the hooked node's output gradient) that holds the examples: for a broadcast,
    :func:`batch_dim`; for a matrix product, that of the shape its rows are folded from. None where no dim fits,
    or where a product's rows are a parameter's (``computed_tables``: also rows computed from parameters alone,
    :func:`~.matmul.computed_from_parameters`, a walk of their graph)."""
    if consumer.is_product:
        if rows_are_parameter(consumer.node, computed_tables):
            return None
        return rows_batch_dim(row_shape(consumer.node, grad_output), batch_size, sequence_first)
    if consumer.is_lookup:
        return _indices_batch_dim(lookup_indices(consumer.node), batch_size, sequence_first)
    dim = batch_dim(grad_output.shape, torch.Size(consumer.path.shape), batch_size, sequence_first)
    if dim is None or any(_may_hold_examples(lookup_indices(view), grad_output.shape[dim])
                          for view in consumer.path.views if type(view).__name__ in LOOKUPS):
        return None  # its rows are not read as a shared table's
    return dim


def _indices_batch_dim(indices: Tensor, batch_size: Optional[int], sequence_first: bool) -> Optional[int]:
    """The dim of a lookup's indices that holds the examples (:func:`~.layout.batch_dim`: dim 0 where the batch's
    size is unknown, the passes' sizes then checked against each other), or None where none can be told or the
    indices are positions shared by the examples (:func:`_may_hold_examples`)."""
    try:
        dim = layout_batch_dim(indices.shape, indices.dim(), batch_size, sequence_first)
    except LayoutError:
        return None
    return dim if _may_hold_examples(indices, int(indices.shape[dim])) else None


def _may_hold_examples(indices: Tensor, examples: int) -> bool:
    """Whether a lookup's indices may hold the examples: :func:`~.embedding.shared_table_reason` finds no shared
    table in them. Its answer needs their values (a device sync) only where some dim has the examples' count or
    there is a single index; otherwise it is "shared" by their shape alone, and the sync is skipped."""
    if examples not in indices.shape and indices.numel() >= 2:
        return False
    return shared_table_reason(indices, examples) is None


def batch_dim(out_shape: torch.Size, param_shape: torch.Size, batch_size: Optional[int],
              sequence_first: bool = False) -> Optional[int]:
    """The dim of the consumer's output that holds the examples: one ``param`` is broadcast along (size 1 there,
    or absent) and of the micro-batch's size where that is known. Dim 0 first in a batch-first model; in a
    sequence-first one, the only such dim, where dims 0 and 1 both fit none (a wrong dim would pass the check that
    the examples' gradients add up, since any dim's rows do). None where no dim fits."""
    if len(param_shape) > len(out_shape):
        return None
    padded = _padded(param_shape, len(out_shape))
    if batch_size is None:
        return 0 if padded[0] == 1 and not sequence_first else None
    fits = [d for d, (n, p) in enumerate(zip(out_shape, padded)) if p == 1 and n == batch_size]
    if not sequence_first:
        return 0 if 0 in fits else (fits[0] if len(fits) == 1 else None)
    if 1 in fits:
        return None if 0 in fits else 1
    return fits[0] if len(fits) == 1 else None


def rows_per_example(consumer: Consumer, grad_output: Tensor, batch_size: Optional[int],
                     sequence_first: bool) -> int:
    """Where a broadcast's output holds no dim of the batch's size but rows that each hold a part of one example,
    example by example (a relative-position bias added to Swin's windows, ``(B·nW, heads, T, T)``;
    :func:`~.window_rows.example_major_rows`), and the parameter is broadcast along them: the rows per example,
    ``nW``. Else 1."""
    if consumer.is_product or consumer.is_lookup or consumer.above is not None or sequence_first or not batch_size:
        return 1
    shape = tuple(grad_output.shape)
    if _padded(torch.Size(consumer.path.shape), len(shape))[0] != 1:
        return 1
    return shape[0] // batch_size if example_major_rows(consumer.node, shape, batch_size) else 1


def example_grads(consumer: Consumer, grad_output: Tensor, dim: int, rows_each: int = 1) -> ExampleGrads:
    """Example ``i``'s gradient of ``P`` through ``consumer``, from the hooked node's output gradient ``grad_output``
    with the examples along ``dim`` (:func:`examples_dim`; module docstring), or ``rows_each`` rows of dim 0 per
    example (:func:`rows_per_example`): (B, P.numel()) float32 :class:`Rows`, or a matrix product's weight's two
    factors (:class:`~.matmul.Factors`)."""
    if consumer.is_product:
        if is_bias(type(consumer.node).__name__, consumer.index):
            return Rows(bias_example_grads(consumer.node, grad_output, dim))
        return weight_factors(consumer.node, consumer.path.transposed, grad_output, dim)
    if consumer.is_lookup:
        return lookup_example_grads(consumer.node, grad_output, dim, consumer.param.shape[0])
    path = consumer.path
    delta = _input_grad(consumer, grad_output.float())
    if rows_each > 1:  # (B·nW, ...) read as (B, nW, ...): each example's rows summed with the broadcast's dims
        delta = delta.reshape(-1, rows_each, *delta.shape[1:])
    padded = _padded(torch.Size(path.shape), delta.dim())
    summed = [d for d, (n, p) in enumerate(zip(delta.shape, padded)) if d != dim and p == 1 and n != 1]
    if summed:
        delta = delta.sum(dim=summed, keepdim=True)
    examples = delta.shape[dim]
    rows = delta.movedim(dim, 0).reshape(examples, -1)
    if path.views:
        rows = back_through(path, rows.reshape(examples, *path.shape)).reshape(examples, -1)
    return Rows(rows.neg() if path.negated else rows)


def _padded(shape: torch.Size, dims: int) -> tuple[int, ...]:
    """``shape`` with leading 1s to ``dims`` dims, as broadcasting reads it."""
    return (1,) * (dims - len(shape)) + tuple(shape)


def _input_grad(consumer: Consumer, delta: Tensor) -> Tensor:
    """``δ`` carried to the parameter's side of the node, before the broadcast dims are summed."""
    kind, node = type(consumer.node).__name__, consumer.node
    if kind == "MulBackward0":
        other = node._saved_other if consumer.index == 0 else node._saved_self
        return delta * other.float()
    if kind in ("AddBackward0", "SubBackward0") and consumer.index == 1:
        alpha = float(node._saved_alpha)
        return delta * (-alpha if kind == "SubBackward0" else alpha)
    if kind == _LAYER_NORM and consumer.index == 1:  # the weight multiplies the normalised input
        return delta * ((node._saved_input.float() - node._saved_result1.float()) * node._saved_result2.float())
    return delta


def adds_up_to(summed: Tensor, grad: Tensor, half_inputs: bool = False) -> Optional[bool]:
    """Whether the examples' summed gradient (numel,) is the parameter's gradient of the pass, to float32
    rounding (bf16/fp16 gradients, or ``half_inputs`` read at a product autocast ran in half precision: theirs);
    None where the gradient is not finite (a gradient scaler's overflow step, which tells nothing). One device
    sync."""
    tolerance = 1e-3 if grad.dtype in (torch.float32, torch.float64) and not half_inputs else 2e-2
    target = grad.detach().float().reshape(-1)
    scale = target.norm()
    if not bool(torch.isfinite(scale)):
        return None
    return bool((summed - target).norm() <= tolerance * scale + 1e-12)
