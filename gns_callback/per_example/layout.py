"""Which dimension of a layer's input holds the examples: dim 0 (batch-first) or dim 1 (sequence-first).

PyTorch's sequence modules default to ``(T, B, ...)`` (``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``,
``nn.LSTM``: ``batch_first=False``), so the ``nn.Linear``/``nn.LayerNorm`` layers around them see the batch in
dim 1. Taking dim 0 there gives per-*position* norms and a confidently wrong noise scale (2.7 against an exact
35.9 on a small encoder). The batch dim of each hooked input is therefore checked against the real batch size
(read off the batch), never assumed:

* dim 0 holds it (and dim 1 does not, or nothing in the model is sequence-first): dim 0;
* dim 1 holds it and dim 0 does not: dim 1, the ``(T, B, ...)`` layout, handled by moving dim 1 to the front;
* both hold it (a sequence as long as the batch): the dim this layer's input held the batch in at its earlier calls,
  where their shapes told it (:class:`LayoutMemory`: with sequences of varying length, one batch as long as it is
  wide must not stop the measurement, nor be read along the positions); with no such call, dim 0, unless the model
  is sequence-first;
* anything else (neither holds it; both do in a sequence-first model with no earlier call to go by; or the size is
  unknown and the model is sequence-first): :class:`LayoutError`, and measuring stops with the reason instead of
  guessing.

Torch only, no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Optional

from torch import Tensor, nn

from .transposed_linear import TransposedLinear, layer_kind
from .param_path import VIEWS, shape_taken
from .window_rows import ACTIVATIONS, example_major_rows

__all__ = ["LayoutError", "LayoutMemory", "batch_dim", "is_sequence_first", "position_dims", "unflattened"]


class LayoutError(ValueError):
    """The batch dim of a layer's input can't be told; the message says why."""


#: How many leading dims of a module's input index examples and positions (the rest are its features). A
#: channels-first layer (convolution, GroupNorm) has only dim 0 for the batch.
_POSITION_DIMS: dict[type, Callable[[nn.Module, Tensor], int]] = {
    nn.Linear: lambda module, inp: inp.dim() - 1,
    TransposedLinear: lambda module, inp: inp.dim() - 1,
    nn.Embedding: lambda module, inp: inp.dim(),
    nn.LayerNorm: lambda module, inp: inp.dim() - len(module.normalized_shape),
    nn.RMSNorm: lambda module, inp: inp.dim() - len(module.normalized_shape),
}


def position_dims(module: nn.Module, inp: Tensor) -> int:
    """Leading dims of ``inp`` that are batch or sequence dims for ``module`` (1 for channels-first layers)."""
    rule = _POSITION_DIMS.get(layer_kind(module))
    return rule(module, inp) if rule is not None else 1


#: Layers whose rows may be an ``(examples × positions)`` flattening: any of their leading dims are positions.
_ROW_LAYERS = (nn.Linear, TransposedLinear, nn.LayerNorm, nn.RMSNorm)

#: Nodes that map row ``r`` of their input to row ``r`` of their output: elementwise activations and dropout (their
#: one input), and the layers of :data:`_ROW_LAYERS` on 2-D rows (the input given: ``addmm``'s rows are its second).
_ROW_WISE = {**dict.fromkeys(ACTIVATIONS, 0), "AddmmBackward0": 1, "MmBackward0": 0, "NativeLayerNormBackward0": 0}

#: How far back through :data:`_ROW_WISE` nodes the flattening is looked for.
_MAX_ROW_WISE = 32


def unflattened(module: nn.Module, inp: Tensor, expected: Optional[int],
                sequence_first: bool = False) -> Optional[tuple[int, ...]]:
    """The shape to read ``inp`` at, where its rows hold no batch of ``expected`` examples but come from a view
    that flattened the examples' positions into rows (``h.view(B·T, D)``, ``h.flatten(0, 1)``), maybe through
    row-wise layers and activations since (:data:`_ROW_WISE`): ``(B, T, *features)``, or ``(T, B, *features)``,
    which :func:`batch_dim` then reads. None otherwise. A view keeps its elements in row-major order, so row
    ``b·T + t`` is position ``t`` of example ``b``: read at the source's leading shape, each example's rows are its
    own. Only for a layer that treats every leading dim as a position (:data:`_ROW_LAYERS`). Otherwise, in a
    batch-first model, rows that each hold a part of one example, example by example (Swin's windows, ``(B·nW, T,
    C)``; :func:`~.window_rows.example_major_rows`): ``(B, nW, T, C)``."""
    if expected is None or inp.shape[0] == expected or layer_kind(module) not in _ROW_LAYERS:
        return None
    leading = _flattened_from(inp.grad_fn, int(inp.shape[0])) if position_dims(module, inp) == 1 else None
    if leading is not None and expected in leading[:2]:
        return (*leading, *inp.shape[1:])
    if sequence_first or not example_major_rows(inp.grad_fn, tuple(inp.shape), expected):
        return None
    return (expected, inp.shape[0] // expected, *inp.shape[1:])


def _flattened_from(node: Any, rows: int) -> Optional[tuple[int, ...]]:
    """The leading dims a view folded into ``rows`` rows, found back from ``node`` through row-wise nodes; None
    where the walk meets anything else first."""
    for _ in range(_MAX_ROW_WISE):
        kind = type(node).__name__
        if kind in VIEWS:
            return _folded(node, rows)
        if kind not in _ROW_WISE or len(node.next_functions) <= _ROW_WISE[kind] or _across_rows(node):
            return None
        node = node.next_functions[_ROW_WISE[kind]][0]
    return None


def _across_rows(node: Any) -> bool:
    """A layer norm whose normalised shape reaches the rows' dim (``F.layer_norm(x, x.shape)``) mixes the rows."""
    if type(node).__name__ != "NativeLayerNormBackward0":
        return False
    return len(node._saved_normalized_shape) >= node._saved_input.dim()


def _folded(view: Any, rows: int) -> Optional[tuple[int, ...]]:
    """The leading dims of the view's input that became its output's ``rows`` rows (its trailing dims kept)."""
    source = tuple(int(n) for n in getattr(view, "_saved_self_sym_sizes", ()))
    output = shape_taken(view)
    if output is None:
        return None
    kept = len(output) - 1
    leading = source[:len(source) - kept]
    if (len(output) < 2 or output[0] != rows or len(leading) < 2 or source[len(leading):] != output[1:]
            or math.prod(leading) != rows):
        return None
    return leading


def is_sequence_first(model: nn.Module) -> bool:
    """Whether any submodule declares ``batch_first=False`` (RNNs, attention, transformer layers)."""
    return any(getattr(module, "batch_first", None) is False for module in model.modules())


def batch_dim(shape: Sequence[int], position_dims: int, expected: Optional[int], sequence_first: bool,
              seen: Optional[int] = None) -> int:
    """0 or 1: the dim of an input of ``shape`` that holds the ``expected`` examples (see the module docstring).

    Args:
        shape: the layer input's shape.
        position_dims: its leading batch/sequence dims (:func:`position_dims`); dim 1 is a candidate only if ≥ 2.
        expected: the micro-batch's size read off the batch, or None if it could not be read.
        sequence_first: the model has a ``batch_first=False`` module (:func:`is_sequence_first`).
        seen: the dim this layer's input held the batch in at earlier calls whose shapes told it
            (:class:`LayoutMemory`), or None; it decides where dims 0 and 1 both equal ``expected``.

    Raises:
        LayoutError: the batch dim can't be told.
    """
    shape = tuple(int(size) for size in shape)
    dim1 = position_dims >= 2
    if expected is None:
        if sequence_first and dim1:
            raise LayoutError(
                f"its input has shape {shape} and the model has sequence-first modules (batch_first=False), but the "
                "micro-batch's size is unknown (it could not be read off the batch, or was not given to "
                "expect_batch_size), so the batch dim can't be told"
            )
        return 0
    zero_holds, one_holds = shape[0] == expected, dim1 and shape[1] == expected
    if zero_holds and one_holds and seen is not None:
        return seen
    if zero_holds and (not one_holds or not sequence_first):
        return 0
    if one_holds and not zero_holds:
        return 1
    if zero_holds:
        raise LayoutError(
            f"its input has shape {shape}: dims 0 and 1 both equal the batch size {expected} and the model has "
            "sequence-first modules (batch_first=False), so the batch dim can't be told; use a batch size that "
            "differs from the sequence length, or batch_first=True"
        )
    where = "neither dim 0 nor dim 1" if dim1 else "dim 0 does not"
    raise LayoutError(
        f"its input has shape {shape}: {where} hold{'s' if dim1 else ''} the batch of {expected} examples "
        f"({_rows_hint(shape[0], expected)})"
    )


def _rows_hint(rows: int, expected: int) -> str:
    """What a layer's ``rows`` leading rows most likely are, given a micro-batch of ``expected`` examples."""
    if 0 < rows < expected and expected % rows == 0:
        return (f"{rows} rows, 1/{expected // rows} of the batch: the forward most likely runs the batch in chunks "
                "inside one backward pass, and a row can't be matched to its example; run each chunk as its own "
                f"micro-batch instead (Lightning: the DataLoader's batch_size={rows} and accumulate_grad_batches "
                f"multiplied by {expected // rows}; a plain loop: one backward pass per chunk), which is the same update")
    return ("the layer runs on something other than the examples, e.g. a learned table or positions shared by all "
            "examples, or the examples are reshaped so that positions become rows")


class LayoutMemory:
    """Per layer, the dim its input held the batch in at the calls whose shapes told it alone (dims 0 and 1 of
    different sizes), for the calls whose shapes don't (:func:`batch_dim`'s ``seen``). A layer seen with the batch
    in both dims is not guessed for."""

    def __init__(self) -> None:
        self._seen: dict[nn.Module, Optional[int]] = {}

    def batch_dim(self, module: nn.Module, inp: Tensor, expected: Optional[int], sequence_first: bool) -> int:
        """:func:`batch_dim` of ``module``'s input ``inp``, remembered where its shape tells it alone."""
        shape, dims = inp.shape, position_dims(module, inp)
        dim = batch_dim(shape, dims, expected, sequence_first, self._seen.get(module))
        if expected is not None and dims >= 2 and shape[0] != shape[1]:
            self._seen[module] = dim if self._seen.get(module, dim) == dim else None
        return dim
