"""Per-example squared gradient norms for ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``, by recomputing the recurrence.

The fused recurrent kernels expose neither the gates nor their gradients to hooks. Yet each layer and direction
applies two linear maps at every step ``t``, ``gi_t = W_ih·x_t + b_ih`` and ``gh_t = W_hh·h_{t−1} + b_hh``, so
example ``i``'s gradients are those of a sequence ``Linear`` (:func:`~.linear.linear_part_sq_norms`):

    ∇W_ih = Σ_t δgi_{i,t}·x_{i,t}ᵀ,   ∇b_ih = Σ_t δgi_{i,t},   ∇W_hh = Σ_t δgh_{i,t}·h_{i,t−1}ᵀ,   ∇b_hh = Σ_t δgh_{i,t}.

The ``δ`` come from recomputing the module's forward step by step (its own parameters, detached; its input and
initial state) and one ``torch.autograd.grad`` of its outputs, with the output gradients the real backward pass
brought, with respect to every layer's ``gi``. For RNN and LSTM ``gi + gh`` enter the cell together, so
``δgh = δgi``; for GRU ``n_t = tanh(gi_n + r_t ⊙ gh_n)``, so ``δgh = (δgi_r, δgi_z, r_t ⊙ δgi_n)`` (Cho et al.
2014, as ``torch.nn.GRU`` documents it). The examples never mix: each row of the recomputation is one example.

Supported: any ``num_layers``, ``bidirectional``, ``batch_first`` either way, with or without biases, an initial
state or none, ``nonlinearity`` tanh or relu. Not supported (the parameters are left out, with the reason):
LSTM projections (``proj_size > 0``) and dropout between layers (random masks the recomputation can't redraw). A
packed or unbatched (2-D) input can't be measured at run time (:func:`input_reason`).

Cost: one more forward and backward of the recurrence, one step at a time. Checked against per-example backward
passes in ``tests/per_example/test_recurrent.py``. Torch only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .linear import linear_part_sq_norms

__all__ = ["RECURRENT_MODULES", "is_recurrent", "recurrent_param_names", "recurrent_unsupported_reason",
           "input_reason", "recurrent_batch_size", "recompute", "recurrent_sq_norms"]

RECURRENT_MODULES = (nn.RNN, nn.LSTM, nn.GRU)


def is_recurrent(module: nn.Module) -> bool:
    """Whether ``module`` is exactly ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU`` (a subclass may override ``forward``)."""
    return type(module) in RECURRENT_MODULES


def _suffixes(module: nn.RNNBase) -> list[str]:
    return ["", "_reverse"] if module.bidirectional else [""]


def recurrent_param_names(module: nn.RNNBase) -> frozenset[str]:
    """The parameters the norms measure: ``weight_ih_l{k}``, ``weight_hh_l{k}`` and their biases, per direction."""
    names = {f"{kind}_{part}_l{layer}{suffix}" for layer in range(module.num_layers) for suffix in _suffixes(module)
             for part in ("ih", "hh") for kind in (("weight", "bias") if module.bias else ("weight",))}
    return frozenset(names)


def recurrent_unsupported_reason(module: nn.RNNBase) -> Optional[str]:
    """Why this recurrent module's parameters can't be measured, or None."""
    if getattr(module, "proj_size", 0) > 0:
        return "an LSTM with proj_size > 0 (projected hidden states) is not measured"
    if module.num_layers > 1 and module.dropout > 0:
        return ("dropout between the layers of a recurrent module draws masks inside the fused kernel that a "
                "recomputation can't redraw; use dropout=0 inside it (put nn.Dropout between modules instead)")
    return None


def input_reason(module: nn.RNNBase, inp: Any) -> Optional[str]:
    """Why this forward's input can't be measured (packed, unbatched), or None."""
    if isinstance(inp, PackedSequence):
        return ("its input is a PackedSequence; pass a padded batch (the recurrence then runs over the padding too, "
                "as the loss sees it)")
    if not isinstance(inp, Tensor) or inp.dim() != 3:
        return "its input is not a batched 3-D tensor, so its examples can't be told"
    return None


def recurrent_batch_size(module: nn.RNNBase, inp: Tensor) -> int:
    """Examples in a batched input: ``(B, T, K)`` if ``batch_first`` else ``(T, B, K)``."""
    return int(inp.shape[0] if module.batch_first else inp.shape[1])


@dataclass
class DirectionPass:
    """What one layer and direction of the recomputation keeps for the norms, batch first ``(B, T, ·)`` in the
    order the steps ran: the layer's input, the state each step started from, the gate pre-activations ``gi``
    (whose gradient is asked for) and, for GRU, the reset gates."""

    suffix: str
    layer: int
    inputs: Tensor
    previous: Tensor
    gates: Tensor
    reset: Optional[Tensor] = None


@dataclass
class Recomputation:
    """The recomputed outputs (``output`` batch first, ``h_n`` and for LSTM ``c_n`` as the module returns them) and
    the per-direction records, in the module's parameter order."""

    output: Tensor
    h_n: Tensor
    c_n: Optional[Tensor]
    passes: list[DirectionPass]


def _cell(module: nn.RNNBase, gi: Tensor, gh: Tensor, h: Tensor, c: Optional[Tensor]
          ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """One step of the cell from its two pre-activations: ``(h', c', r)`` (``c'`` for LSTM, ``r`` for GRU)."""
    if isinstance(module, nn.LSTM):
        i, f, g, o = (gi + gh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c, None
    if isinstance(module, nn.GRU):
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        return (1 - z) * torch.tanh(in_ + r * hn) + z * h, None, r
    pre = gi + gh
    return (torch.tanh(pre) if module.nonlinearity == "tanh" else torch.relu(pre)), None, None


def _initial_states(module: nn.RNNBase, hx: Any, batch: int, like: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """``(h_0, c_0)`` as ``(layers·directions, B, H)``, zeros where the forward got none."""
    shape = (module.num_layers * len(_suffixes(module)), batch, module.hidden_size)
    if isinstance(module, nn.LSTM):
        h0, c0 = hx if hx is not None else (None, None)
        zeros = like.new_zeros(shape)
        return (zeros if h0 is None else h0.detach().to(like.dtype)), (zeros if c0 is None else c0.detach().to(like.dtype))
    return (like.new_zeros(shape) if hx is None else hx.detach().to(like.dtype)), None


def _direction(module: nn.RNNBase, layer: int, suffix: str, inputs: Tensor, h: Tensor, c: Optional[Tensor],
               first: bool) -> tuple[Tensor, Tensor, Optional[Tensor], DirectionPass]:
    """One layer and direction over ``inputs`` (B, T, K): its outputs in time order, last ``h`` and ``c``, and
    its record. ``gi`` is a leaf that requires grad on the first layer (its input is data) and a node after it."""
    weight = lambda name: getattr(module, f"{name}_l{layer}{suffix}").detach().to(inputs.dtype)  # noqa: E731
    bias = lambda name: weight(name) if module.bias else None  # noqa: E731
    gates = torch.nn.functional.linear(inputs, weight("weight_ih"), bias("bias_ih"))
    if first:
        gates.requires_grad_(True)
    w_hh, b_hh = weight("weight_hh"), bias("bias_hh")
    order = range(inputs.shape[1] - 1, -1, -1) if suffix else range(inputs.shape[1])
    outputs, previous, resets = [], [], []
    for t in order:
        previous.append(h)
        h, c, r = _cell(module, gates[:, t], torch.nn.functional.linear(h, w_hh, b_hh), h, c)
        outputs.append(h)
        resets.append(r)
    if suffix:
        outputs, previous, resets = outputs[::-1], previous[::-1], resets[::-1]
    reset = torch.stack(resets, 1) if isinstance(module, nn.GRU) else None
    record = DirectionPass(suffix, layer, inputs.detach(), torch.stack(previous, 1).detach(), gates,
                           None if reset is None else reset.detach())
    return torch.stack(outputs, 1), h, c, record


def recompute(module: nn.RNNBase, inp: Tensor, hx: Any = None) -> Recomputation:
    """The module's forward, step by step, with the gate pre-activations kept (grad must be enabled)."""
    x = inp.detach()
    x = x if module.batch_first else x.transpose(0, 1)
    dtype = torch.promote_types(x.dtype, torch.float32)
    x = x.to(dtype)
    h0, c0 = _initial_states(module, hx, x.shape[0], x)
    suffixes = _suffixes(module)
    h_n, c_n, passes = [], [], []
    layer_input = x
    for layer in range(module.num_layers):
        outputs = []
        for d, suffix in enumerate(suffixes):
            k = layer * len(suffixes) + d
            out, h, c, record = _direction(module, layer, suffix, layer_input, h0[k],
                                           None if c0 is None else c0[k], first=layer == 0)
            outputs.append(out)
            h_n.append(h)
            c_n.append(c)
            passes.append(record)
        layer_input = torch.cat(outputs, -1)
    return Recomputation(layer_input, torch.stack(h_n), torch.stack(c_n) if c0 is not None else None, passes)


def _state_gradients(module: nn.RNNBase, recomputed: Recomputation, grads: Sequence[Optional[Tensor]]
                     ) -> list[Tensor]:
    """``δgi`` of every direction, from the gradients of the module's outputs ``(output, h_n[, c_n])`` (None where
    the loss did not use one); ``output``'s gradient comes in the module's own layout."""
    outputs, grad_outputs = [], []
    grad_output = grads[0]
    if grad_output is not None and not module.batch_first:
        grad_output = grad_output.transpose(0, 1)
    for tensor, grad in zip((recomputed.output, recomputed.h_n, recomputed.c_n), (grad_output, *grads[1:])):
        if tensor is not None and grad is not None:
            outputs.append(tensor)
            grad_outputs.append(grad.to(tensor.dtype))
    gates = [record.gates for record in recomputed.passes]
    found = torch.autograd.grad(outputs, gates, grad_outputs, allow_unused=True)
    return [torch.zeros_like(g) if d is None else d for g, d in zip(gates, found)]


def _hidden_gradient(module: nn.RNNBase, record: DirectionPass, gate_grad: Tensor) -> Tensor:
    """``δgh`` from ``δgi``: the same for RNN and LSTM; for GRU the new-gate block is scaled by the reset gate."""
    if record.reset is None:
        return gate_grad
    r_z, n = gate_grad.split([2 * module.hidden_size, module.hidden_size], -1)
    return torch.cat([r_z, record.reset * n], -1)


def recurrent_sq_norms(module: nn.RNNBase, inp: Tensor, hx: Any, grads: Sequence[Optional[Tensor]],
                       param_names: Collection[str]) -> tuple[Tensor, Tensor]:
    """Per-example squared gradient norm ``(B,)`` of the parameters ``param_names``, and the recomputed ``output``
    (batch first), from the forward's input and initial state and the gradients of its outputs
    ``(output, h_n[, c_n])`` (module docstring)."""
    with torch.enable_grad():
        recomputed = recompute(module, inp, hx)
        gate_grads = _state_gradients(module, recomputed, grads)
    with torch.no_grad():
        total = recomputed.output.new_zeros(recomputed.output.shape[0])
        for record, gate_grad in zip(recomputed.passes, gate_grads):
            name = lambda kind, part: f"{kind}_{part}_l{record.layer}{record.suffix}"  # noqa: E731
            total += linear_part_sq_norms(record.inputs, gate_grad, name("weight", "ih") in param_names,
                                          name("bias", "ih") in param_names)
            total += linear_part_sq_norms(record.previous, _hidden_gradient(module, record, gate_grad),
                                          name("weight", "hh") in param_names, name("bias", "hh") in param_names)
    return total, recomputed.output.detach()
