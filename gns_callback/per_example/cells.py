"""Per-example squared gradient norms for ``nn.RNNCell``, ``nn.LSTMCell`` and ``nn.GRUCell``, call by call.

A cell is one step of :mod:`.recurrent`'s recurrence, applied by a loop of the user's own (a decoder, a model that
feeds its output back). Each call ``t`` applies two linear maps, ``gi_t = W_ih·x_t + b_ih`` and
``gh_t = W_hh·h_{t−1} + b_hh``, so over the calls of one backward pass example ``i``'s gradients are those of a
sequence ``Linear`` whose positions are the calls (:func:`~.linear.linear_part_sq_norms`):

    ∇W_ih = Σ_t δgi_{i,t}·x_{i,t}ᵀ,  ∇b_ih = Σ_t δgi_{i,t},  ∇W_hh = Σ_t δgh_{i,t}·h_{i,t−1}ᵀ,  ∇b_hh = Σ_t δgh_{i,t}.

Autograd brings each call the gradient of its outputs (``h_t``, and ``c_t`` for LSTM) with every later call's
share already in it, so no backpropagation through time is needed here: a call's ``δgi``, ``δgh`` are the cell's
own derivative at that call (:func:`~.recurrent.lstm_terms`, :func:`~.recurrent.gru_terms`,
:func:`~.recurrent.rnn_slope`), from its input and state (the gates recomputed, no autograd) and its output
gradients. An LSTM call's ``c_t`` gradient is read as autograd's graph makes it (:func:`state_feeds_output`): torch's
CPU cell computes ``h_t`` from the ``c_t`` it returns, so that gradient already holds the path through ``h_t``; a
fused cell (CUDA) returns both from one node, and the path is added here. The tracker keeps the calls of a pass and
reads them as one when the cell's parameter gradient arrives, as for a layer applied several times
(:mod:`.repeated`). An unbatched (1-D) input can't be measured.

Checked against per-example backward passes in ``tests/per_example/test_cells.py``. Torch only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import linear_part_sq_norms
from .recurrent import gru_terms, lstm_step, lstm_terms, rnn_slope
from .subclass import runs_as

__all__ = ["CELL_MODULES", "CELL_PARAM_NAMES", "CellCall", "cell_call", "cell_input_reason", "cell_outputs",
           "cell_sq_norms", "is_cell", "state_feeds_output"]

CELL_MODULES = (nn.RNNCell, nn.LSTMCell, nn.GRUCell)
#: A cell's parameters, all measured.
CELL_PARAM_NAMES = frozenset({"weight_ih", "weight_hh", "bias_ih", "bias_hh"})


def is_cell(module: nn.Module) -> bool:
    """Whether ``module`` runs as one of :data:`CELL_MODULES` (:func:`~.subclass.runs_as`)."""
    return runs_as(type(module)) in CELL_MODULES


def cell_input_reason(inp: Any) -> Optional[str]:
    """Why this call's input can't be measured (not a batch), or None."""
    if not isinstance(inp, Tensor) or inp.dim() != 2:
        return "its input is not a batched 2-D tensor (an unbatched call), so its examples can't be told"
    return None


def cell_outputs(output: Any) -> list[tuple[int, Tensor]]:
    """``(index, tensor)`` of a call's outputs that require grad: 0 ``h``, 1 ``c`` (LSTM)."""
    tensors = output if isinstance(output, tuple) else (output,)
    return [(k, t) for k, t in enumerate(tensors) if isinstance(t, Tensor) and t.requires_grad]


def state_feeds_output(output: Any, depth: int = 5) -> bool:
    """Whether an ``nn.LSTMCell`` call's ``h`` was computed from the ``c`` it returns, within ``depth`` nodes of
    autograd's graph (torch's composite cell: ``h = o·tanh(c)``), so that ``c``'s gradient includes the path
    through ``h``; False where one fused node returns both (CUDA) or for another cell."""
    if not (isinstance(output, tuple) and len(output) == 2) or output[1].grad_fn is None:
        return False
    target, frontier = output[1].grad_fn, [output[0].grad_fn]
    for _ in range(depth):
        frontier = [node for fn in frontier if fn is not None for node, _ in fn.next_functions]
        if any(node is target for node in frontier):
            return True
    return False


@dataclass
class CellCall:
    """One call, batch first: its input, the state it started from, and its gates' gradients."""

    inputs: Tensor
    previous: Tensor
    gi_grad: Tensor
    gh_grad: Tensor


def _weights(module: nn.Module, part: str, dtype: torch.dtype) -> tuple[Tensor, Optional[Tensor]]:
    bias = getattr(module, f"bias_{part}") if module.bias else None
    return (getattr(module, f"weight_{part}").detach().to(dtype),
            None if bias is None else bias.detach().to(dtype))


def _state(module: nn.Module, hx: Any, like: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """``(h, c)`` the call started from (zeros where none was given; ``c`` for LSTM only)."""
    zeros = like.new_zeros(like.shape[0], module.hidden_size)
    if isinstance(module, nn.LSTMCell):
        h, c = hx if hx is not None else (None, None)
        return tuple(zeros if s is None else s.detach().to(like.dtype) for s in (h, c))  # type: ignore[return-value]
    return (zeros if hx is None else hx.detach().to(like.dtype)), None


def cell_call(module: nn.Module, inp: Tensor, hx: Any, grads: Sequence[Optional[Tensor]],
              state_grad_is_total: bool = False) -> CellCall:
    """The gates' gradients of one call of ``module`` from its input ``inp`` (B, K), its state ``hx`` (None, ``h``,
    or ``(h, c)``) and the gradients of its outputs ``(h'[, c'])`` (None where the loss did not use one).
    ``state_grad_is_total``: ``c'``'s gradient already holds the path through ``h'`` (:func:`state_feeds_output`)."""
    with torch.no_grad():
        x = inp.detach().to(torch.promote_types(inp.dtype, torch.float32))
        h, c = _state(module, hx, x)
        gi, gh = F.linear(x, *_weights(module, "ih", x.dtype)), F.linear(h, *_weights(module, "hh", x.dtype))
        dh, dc = (torch.zeros_like(h) if g is None else g.detach().to(x.dtype) for g in (*grads, None)[:2])
        if isinstance(module, nn.LSTMCell):
            gi_grad = gh_grad = _lstm_gate_grads(gi, gh, h, c, dh, dc, state_grad_is_total)
        elif isinstance(module, nn.GRUCell):
            gi_grad, gh_grad = _gru_gate_grads(gi, gh, h, dh)
        else:
            pre = gi + gh
            out = torch.tanh(pre) if module.nonlinearity == "tanh" else torch.relu(pre)
            gi_grad = gh_grad = dh * rnn_slope(out, module.nonlinearity)
    return CellCall(x, h, gi_grad, gh_grad)


def _lstm_gate_grads(gi: Tensor, gh: Tensor, h: Tensor, c: Tensor, dh: Tensor, dc: Tensor,
                     state_grad_is_total: bool) -> Tensor:
    """``δgates`` of one LSTM call (:func:`~.recurrent.lstm_terms`); ``dc`` is ``c'``'s gradient, with the path
    through ``h'`` already in it if ``state_grad_is_total``."""
    local, through_c, _ = lstm_terms(gi, gh, c, lstm_step(gi, gh, h, c)[1])
    dc = dc if state_grad_is_total else dh * through_c + dc
    return torch.cat([dc, dc, dc, dh], -1) * local


def _gru_gate_grads(gi: Tensor, gh: Tensor, h: Tensor, dh: Tensor) -> tuple[Tensor, Tensor]:
    """``(δgi, δgh)`` of one GRU call (:func:`~.recurrent.gru_terms`)."""
    to_n, to_z, to_r, r, _ = gru_terms(gi, gh, h)
    dn, dz = dh * to_n, dh * to_z
    dr = dn * to_r
    return torch.cat([dr, dz, dn], -1), torch.cat([dr, dz, dn * r], -1)


def cell_sq_norms(calls: Sequence[CellCall], param_names: Collection[str]) -> Tensor:
    """Per-example squared gradient norm ``(B,)`` of the cell's parameters ``param_names`` over ``calls``
    (module docstring)."""
    def stacked(field: str) -> Tensor:
        return torch.stack([getattr(call, field) for call in calls], 1)  # (B, calls, ·)

    with torch.no_grad():
        return (linear_part_sq_norms(stacked("inputs"), stacked("gi_grad"), "weight_ih" in param_names,
                                     "bias_ih" in param_names)
                + linear_part_sq_norms(stacked("previous"), stacked("gh_grad"), "weight_hh" in param_names,
                                       "bias_hh" in param_names))
