"""Per-example squared gradient norms for ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``, by recomputing the recurrence.

The fused recurrent kernels expose neither the gates nor their gradients to hooks. Yet each layer and direction
applies two linear maps at every step ``t``, ``gi_t = W_ih·x_t + b_ih`` and ``gh_t = W_hh·h_{t−1} + b_hh``, so
example ``i``'s gradients are those of a sequence ``Linear`` (:func:`~.linear.linear_part_sq_norms`):

    ∇W_ih = Σ_t δgi_{i,t}·x_{i,t}ᵀ,  ∇b_ih = Σ_t δgi_{i,t},  ∇W_hh = Σ_t δgh_{i,t}·h_{i,t−1}ᵀ,  ∇b_hh = Σ_t δgh_{i,t}.

The ``δ`` come from recomputing the module's forward step by step (its own parameters, its input and initial
state, no autograd), then backpropagating through time by hand from the output gradients the real backward pass
brought (``output``, ``h_n``, ``c_n``): the cells' derivatives below, as ``torch.nn`` documents the cells (LSTM:
Hochreiter & Schmidhuber 1997; GRU: Cho et al. 2014). For RNN and LSTM ``gi + gh`` enter the cell together, so
``δgh = δgi``; for GRU ``n_t = tanh(gi_n + r_t ⊙ gh_n)``, so ``δgh = (δgi_r, δgi_z, r_t ⊙ δgi_n)``. A stacked
module's lower layers get their output gradient from the layer above, ``Σ_directions δgi·W_ih``. Each row of the
recomputation is one example; they never mix. By hand rather than with autograd through the unrolled loop: the
2-layer LSTM of ``benchmarks/recurrent_cost.py`` then takes 2.25× a plain step instead of 3.39×.

Supported: any ``num_layers``, ``bidirectional``, ``batch_first`` either way, with or without biases, an initial
state or none, ``nonlinearity`` tanh or relu. Not supported (the parameters are left out, with the reason):
LSTM projections (``proj_size > 0``) and dropout between layers (random masks the recomputation can't redraw). A
packed or unbatched (2-D) input can't be measured at run time (:func:`input_reason`).

Cost: one more forward and backward of the recurrence, one step at a time in Python (``benchmarks/RESULTS.md``).
Checked against per-example backward passes in ``tests/per_example/test_recurrent.py``. Torch only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from .linear import linear_part_sq_norms
from .subclass import runs_as

__all__ = ["RECURRENT_MODULES", "is_recurrent", "recurrent_param_names", "recurrent_unsupported_reason",
           "input_reason", "recurrent_batch_size", "recompute", "recurrent_sq_norms", "lstm_terms", "gru_terms",
           "rnn_slope", "lstm_step"]

RECURRENT_MODULES = (nn.RNN, nn.LSTM, nn.GRU)


def is_recurrent(module: nn.Module) -> bool:
    """Whether ``module`` runs as ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU`` (:func:`~.subclass.runs_as`)."""
    return runs_as(type(module)) in RECURRENT_MODULES


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
class Direction:
    """One layer and direction of the recomputation, time-major ``(T, B, ·)`` in the order its steps ran
    (reversed for a ``_reverse`` direction): the layer's input, the state each step started from, its outputs, the
    gate pre-activations ``gi`` and ``gh`` and, for LSTM, the cell states; then the gates' gradients."""

    layer: int
    suffix: str
    inputs: Tensor
    cell0: Optional[Tensor] = None
    previous: Optional[Tensor] = None
    outputs: Optional[Tensor] = None
    gi: Optional[Tensor] = None
    gh: Optional[Tensor] = None
    cells: Optional[Tensor] = None
    gi_grad: Optional[Tensor] = None
    gh_grad: Optional[Tensor] = None

    def weight(self, module: nn.RNNBase, name: str) -> Optional[Tensor]:
        """This direction's ``weight_ih``, ``weight_hh``, ``bias_ih`` or ``bias_hh`` (None: no biases)."""
        if name.startswith("bias") and not module.bias:
            return None
        return getattr(module, f"{name}_l{self.layer}{self.suffix}").detach().to(self.inputs.dtype)


@dataclass
class Recomputation:
    """The recomputed outputs (``output`` batch first; ``h_n`` and for LSTM ``c_n`` as the module returns them)
    and every layer's directions, in the module's parameter order."""

    output: Tensor
    h_n: Tensor
    c_n: Optional[Tensor]
    layers: list[list[Direction]]


def _initial_states(module: nn.RNNBase, hx: Any, batch: int, like: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """``(h_0, c_0)`` as ``(layers·directions, B, H)``, zeros where the forward got none."""
    shape = (module.num_layers * len(_suffixes(module)), batch, module.hidden_size)
    zeros = like.new_zeros(shape)
    if isinstance(module, nn.LSTM):
        h0, c0 = hx if hx is not None else (None, None)
        h0, c0 = (zeros if state is None else state.detach().to(like.dtype) for state in (h0, c0))
        return h0, c0
    return (zeros if hx is None else hx.detach().to(like.dtype)), None


def lstm_step(gi: Tensor, gh: Tensor, h: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    i, f, g, o = (gi + gh).chunk(4, -1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def _gru_step(gi: Tensor, gh: Tensor, h: Tensor) -> Tensor:
    (ir, iz, i_n), (hr, hz, h_n) = gi.chunk(3, -1), gh.chunk(3, -1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    return torch.lerp(torch.tanh(i_n + r * h_n), h, z)  # (1 − z)·n + z·h


def _forward_direction(module: nn.RNNBase, direction: Direction, h: Tensor, c: Optional[Tensor]) -> Direction:
    """Run one direction over its inputs (``direction.inputs``, processing order), filling in the rest."""
    w_hh, b_hh = direction.weight(module, "weight_hh"), direction.weight(module, "bias_hh")
    gi = F.linear(direction.inputs, direction.weight(module, "weight_ih"), direction.weight(module, "bias_ih"))
    previous, gh, cells = [], [], []
    for t in range(gi.shape[0]):
        previous.append(h)
        gh.append(F.linear(h, w_hh, b_hh))
        if isinstance(module, nn.LSTM):
            h, c = lstm_step(gi[t], gh[t], h, c)
            cells.append(c)
        elif isinstance(module, nn.GRU):
            h = _gru_step(gi[t], gh[t], h)
        else:
            pre = gi[t] + gh[t]
            h = torch.tanh(pre) if module.nonlinearity == "tanh" else torch.relu(pre)
    direction.previous, direction.gi, direction.gh = torch.stack(previous), gi, torch.stack(gh)
    direction.outputs = torch.cat([direction.previous[1:], h.unsqueeze(0)])
    direction.cells = torch.stack(cells) if cells else None
    return direction


def _replay_direction(module: nn.RNNBase, direction: Direction, h: Tensor, c: Optional[Tensor],
                      outputs: Tensor) -> Direction:
    """:func:`_forward_direction` for a direction whose outputs are known (the top layer's, from the module's own
    forward): the gate pre-activations in two matrix products, and for LSTM the cell states by their linear
    recurrence ``c = f·c' + i·g``, one fused op a step."""
    direction.outputs = outputs
    direction.previous = torch.cat([h.unsqueeze(0), outputs[:-1]])
    direction.gi = F.linear(direction.inputs, direction.weight(module, "weight_ih"),
                            direction.weight(module, "bias_ih"))
    direction.gh = F.linear(direction.previous, direction.weight(module, "weight_hh"),
                            direction.weight(module, "bias_hh"))
    if isinstance(module, nn.LSTM):
        i, f, g, _ = (direction.gi + direction.gh).chunk(4, -1)
        f, fresh = torch.sigmoid(f), torch.sigmoid(i) * torch.tanh(g)
        direction.cells = torch.empty_like(fresh)
        for t in range(fresh.shape[0]):
            c = torch.addcmul(fresh[t], f[t], c, out=direction.cells[t])
    return direction


def recompute(module: nn.RNNBase, inp: Tensor, hx: Any = None, output: Optional[Tensor] = None) -> Recomputation:
    """The module's forward, keeping what backpropagation through time needs (no autograd): step by step, except
    for the top layer when the module's own ``output`` (in its layout) is given."""
    with torch.no_grad():
        x = inp.detach().to(torch.promote_types(inp.dtype, torch.float32))
        x = x.transpose(0, 1) if module.batch_first else x  # time-major
        known = None if output is None else output.detach().to(x.dtype)
        known = known.transpose(0, 1) if known is not None and module.batch_first else known
        h0, c0 = _initial_states(module, hx, x.shape[1], x)
        suffixes, layers, layer_input = _suffixes(module), [], x
        for layer in range(module.num_layers):
            top = known if layer == module.num_layers - 1 else None
            directions = []
            for d, suffix in enumerate(suffixes):
                k = layer * len(suffixes) + d
                direction = Direction(layer, suffix, layer_input.flip(0) if suffix else layer_input,
                                      None if c0 is None else c0[k])
                if top is None:
                    directions.append(_forward_direction(module, direction, h0[k], direction.cell0))
                else:
                    outputs = _in_time_order(top.chunk(len(suffixes), -1)[d], direction)
                    directions.append(_replay_direction(module, direction, h0[k], direction.cell0, outputs))
            layers.append(directions)
            layer_input = torch.cat([_in_time_order(d.outputs, d) for d in directions], -1)
        finals = [d.outputs[-1] for directions in layers for d in directions]
        cells = [d.cells[-1] for directions in layers for d in directions] if c0 is not None else None
        return Recomputation(layer_input.transpose(0, 1), torch.stack(finals),
                             None if cells is None else torch.stack(cells), layers)


def _in_time_order(tensor: Tensor, direction: Direction) -> Tensor:
    """A time-major tensor of ``direction`` in the sequence's order (processing order flipped back)."""
    return tensor.flip(0) if direction.suffix else tensor


def lstm_terms(gi: Tensor, gh: Tensor, before: Tensor, cells: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(local, through_c, f)`` of LSTM steps (any leading dims) with gate pre-activations ``gi + gh``, the cell
    states they started from (``before``) and made (``cells``): ``c = f·c' + i·g``, ``h = o·tanh(c)``. A step's
    gates' gradient is ``(dc, dc, dc, dh)·local`` for ``dh`` its output's and ``dc = dh·through_c + δc`` its cell
    state's; ``f`` carries ``dc`` one step back."""
    i, f, g, o = (gi + gh).chunk(4, -1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    tanh_c = torch.tanh(cells)
    through_c = o * (1 - tanh_c * tanh_c)  # ∂h/∂c
    local = torch.cat([g * i * (1 - i), before * f * (1 - f), i * (1 - g * g), tanh_c * o * (1 - o)], -1)
    return local, through_c, f


def gru_terms(gi: Tensor, gh: Tensor, previous: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(to_n, to_z, to_r, r, z)`` of GRU steps (any leading dims) started from ``previous``: ``h = (1 − z)·n +
    z·h'``, ``n = tanh(gi_n + r·gh_n)``. For ``dh`` a step's output gradient, ``dn = dh·to_n``, ``dz = dh·to_z``,
    ``dr = dn·to_r``; ``δgi = (dr, dz, dn)`` and ``δgh = (dr, dz, r·dn)``."""
    (ir, iz, i_n), (hr, hz, h_n) = gi.chunk(3, -1), gh.chunk(3, -1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    n = torch.tanh(i_n + r * h_n)
    return (1 - z) * (1 - n * n), (previous - n) * z * (1 - z), h_n * r * (1 - r), r, z


def rnn_slope(outputs: Tensor, nonlinearity: str) -> Tensor:
    """``∂h/∂pre`` of Elman RNN steps from their outputs: ``1 − h²`` for tanh, ``h > 0`` for relu."""
    return 1 - outputs * outputs if nonlinearity == "tanh" else (outputs > 0).to(outputs.dtype)


def _lstm_backward(module: nn.RNNBase, direction: Direction, grad_out: Tensor, grad_h: Tensor,
                   grad_c: Tensor) -> Tensor:
    """δgates of one LSTM direction (:func:`lstm_terms`); all but the recurrence vectorised."""
    before = torch.cat([direction.cell0.unsqueeze(0), direction.cells[:-1]])
    local, through_c, f = lstm_terms(direction.gi, direction.gh, before, direction.cells)
    w_hh, grads = direction.weight(module, "weight_hh"), torch.empty_like(local)
    for t in range(local.shape[0] - 1, -1, -1):
        dh = grad_out[t] + grad_h
        dc = dh * through_c[t] + grad_c
        torch.mul(torch.cat([dc, dc, dc, dh], -1), local[t], out=grads[t])
        grad_c, grad_h = dc * f[t], grads[t] @ w_hh
    return grads


def _gru_backward(module: nn.RNNBase, direction: Direction, grad_out: Tensor, grad_h: Tensor) -> tuple[Tensor, Tensor]:
    """``(δgi, δgh)`` of one GRU direction (:func:`gru_terms`)."""
    to_n, to_z, to_r, r, z = gru_terms(direction.gi, direction.gh, direction.previous)
    w_hh = direction.weight(module, "weight_hh")
    gi_grad, gh_grad = torch.empty_like(direction.gi), torch.empty_like(direction.gh)
    for t in range(r.shape[0] - 1, -1, -1):
        dh = grad_out[t] + grad_h
        dn = dh * to_n[t]
        dz, dr = dh * to_z[t], dn * to_r[t]
        torch.cat([dr, dz, dn], -1, out=gi_grad[t])
        torch.cat([dr, dz, dn * r[t]], -1, out=gh_grad[t])
        grad_h = dh * z[t] + gh_grad[t] @ w_hh
    return gi_grad, gh_grad


def _rnn_backward(module: nn.RNNBase, direction: Direction, grad_out: Tensor, grad_h: Tensor) -> Tensor:
    """δpre of one Elman RNN direction, ``h = tanh(pre)`` or ``relu(pre)``."""
    h = direction.outputs
    slope = rnn_slope(h, module.nonlinearity)
    w_hh, grads = direction.weight(module, "weight_hh"), torch.empty_like(h)
    for t in range(h.shape[0] - 1, -1, -1):
        torch.mul(grad_out[t] + grad_h, slope[t], out=grads[t])
        grad_h = grads[t] @ w_hh
    return grads


def _backward_direction(module: nn.RNNBase, direction: Direction, grad_out: Tensor, grad_h: Tensor,
                        grad_c: Optional[Tensor]) -> None:
    """Fill in ``gi_grad`` and ``gh_grad`` from the gradient of the direction's outputs (processing order) and of
    its final state(s)."""
    if isinstance(module, nn.LSTM):
        direction.gi_grad = direction.gh_grad = _lstm_backward(module, direction, grad_out, grad_h, grad_c)
    elif isinstance(module, nn.GRU):
        direction.gi_grad, direction.gh_grad = _gru_backward(module, direction, grad_out, grad_h)
    else:
        direction.gi_grad = direction.gh_grad = _rnn_backward(module, direction, grad_out, grad_h)


def backpropagate(module: nn.RNNBase, recomputed: Recomputation, grads: Sequence[Optional[Tensor]]) -> None:
    """Every direction's gate gradients from the gradients of the module's outputs ``(output, h_n[, c_n])`` (None
    where the loss did not use one; ``output``'s in the module's own layout), top layer first."""
    dtype = recomputed.output.dtype
    with torch.no_grad():
        grad_output, grad_h, grad_c = (None if g is None else g.detach().to(dtype) for g in (*grads, None)[:3])
        grad_output = torch.zeros_like(recomputed.output) if grad_output is None else grad_output
        above = grad_output if not module.batch_first else grad_output.transpose(0, 1)  # time-major
        grad_h = torch.zeros_like(recomputed.h_n) if grad_h is None else grad_h
        if recomputed.c_n is not None and grad_c is None:
            grad_c = torch.zeros_like(recomputed.c_n)
        count = len(_suffixes(module))
        for layer in range(module.num_layers - 1, -1, -1):
            directions = recomputed.layers[layer]
            for d, (direction, part) in enumerate(zip(directions, above.chunk(count, -1))):
                k = layer * count + d
                _backward_direction(module, direction, _in_time_order(part, direction), grad_h[k],
                                    None if grad_c is None else grad_c[k])
            above = sum(_in_time_order(d.gi_grad @ d.weight(module, "weight_ih"), d) for d in directions)


def recurrent_sq_norms(module: nn.RNNBase, inp: Tensor, hx: Any, grads: Sequence[Optional[Tensor]],
                       param_names: Collection[str], output: Optional[Tensor] = None) -> Tensor:
    """Per-example squared gradient norm ``(B,)`` of the parameters ``param_names``, from the forward's input and
    initial state and the gradients of its outputs ``(output, h_n[, c_n])`` (module docstring). ``output``: the
    forward's own, which spares recomputing the top layer's steps."""
    recomputed = recompute(module, inp, hx, output)
    backpropagate(module, recomputed, grads)
    with torch.no_grad():
        total = recomputed.output.new_zeros(recomputed.output.shape[0])
        for direction in (d for directions in recomputed.layers for d in directions):
            total += _direction_sq_norms(direction, param_names)
    return total


def _direction_sq_norms(direction: Direction, param_names: Collection[str]) -> Tensor:
    """Per-example squared norms of one direction's four parameters (those in ``param_names``), batch first."""
    def name(kind: str, part: str) -> str:
        return f"{kind}_{part}_l{direction.layer}{direction.suffix}"

    first = lambda tensor: tensor.transpose(0, 1)  # noqa: E731
    return (linear_part_sq_norms(first(direction.inputs), first(direction.gi_grad), name("weight", "ih") in param_names,
                                 name("bias", "ih") in param_names)
            + linear_part_sq_norms(first(direction.previous), first(direction.gh_grad),
                                   name("weight", "hh") in param_names, name("bias", "hh") in param_names))
