"""``method="micro_batch"``: each backward pass's local gradient norm, from parameter hooks (torch, no Lightning).

``Tensor.register_hook`` on a parameter sees the gradient of one backward pass *before* it is accumulated
into ``.grad`` and before DDP reduces it: exactly one micro-batch's local gradient ``ĝ_j``, still carrying
the AMP loss scale and the loss divisor (Lightning's ``1/accumulate_grad_batches``). The unit of the
small-batch term is the whole micro-batch (size ``b_j``): :meth:`MicroBatchCollector.pop_into` adds
``b_j·|ḡ_j|²`` with ``ḡ_j = divisor·ĝ_j`` (mean loss) or ``divisor·ĝ_j/b_j`` (sum loss).

Where ``.grad`` already holds a gradient (the second and later micro-batches of a step), the hooks only hold
each incoming gradient, and ``torch._foreach_norm`` squares and sums them a bucket at a time (at most
:data:`BUCKET_BYTES` held, or at the end of the backward pass): a few multi-tensor kernels per pass instead of a
kernel per parameter, which on a GPU is host time the device waits for (benchmarks/RESULTS.md, "GPU: overhead of
the callback"). Into an empty ``.grad`` autograd adopts the gradient tensor itself, unless something else holds
it, in which case it copies it: those gradients are squared at once instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gns_callback.accumulation import AccumulationWindow, LossReduction
from gns_callback.collectors.coverage import Coverage
from gns_callback.norms import squared_norm, squared_norm_sum
from gns_callback.own_hooks import OwnHook
from gns_callback.backward_passes import PassLedger, hooks_inert

#: Gradient bytes the hooks hold before squaring them in one multi-tensor kernel (the extra memory, at most).
BUCKET_BYTES = 32 * 2**20


@dataclass
class _Held:
    """One backward pass's gradients held until they are squared together, and their bytes."""

    grads: list[torch.Tensor] = field(default_factory=list)
    bytes: int = 0

    def add(self, grad: torch.Tensor) -> None:
        self.grads.append(grad)
        self.bytes += grad.numel() * grad.element_size()


@dataclass
class _PassSquares:
    """One backward pass: its squared-norm parts, the parameters whose gradients they hold, and why it can't be
    measured (None: it can)."""

    parts: list[torch.Tensor] = field(default_factory=list)
    params: set[int] = field(default_factory=set)
    failure: Optional[str] = None

    def saw(self, param: nn.Parameter) -> None:
        """A gradient of ``param`` arrived: a second one in the same pass fails it (:data:`_TWICE`)."""
        if id(param) in self.params:
            self.failure = _TWICE
        self.params.add(id(param))

    def merged(self, inner: _PassSquares) -> _PassSquares:
        """This pass with another part of the same backward pass (a reentrant checkpoint's segment,
        :class:`PassLedger`): squared norms of disjoint parameters add."""
        self.failure = self.failure or inner.failure or (_TWICE if self.params & inner.params else None)
        self.parts += inner.parts
        self.params |= inner.params
        return self


#: A parameter gets two gradients in one backward pass only from nested passes: reentrant gradient checkpointing
#: with the parameter used in two checkpointed segments, or in one and outside it.
_TWICE = (
    "a parameter received gradients from two parts of one backward pass (reentrant gradient checkpointing, with the "
    "parameter used in two checkpointed segments or inside and outside one): the micro-batch's gradient norm is not "
    "the sum of the parts' norms. Pass use_reentrant=False to torch.utils.checkpoint."
)


class MicroBatchCollector:
    """Sums ``|∂L/∂p|²`` over the trainable parameters of ``model`` for each backward pass."""

    method = "micro_batch"
    needs_batch_sizes = True

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.enabled = True
        self._params: list[nn.Parameter] = []
        self._handles: list[RemovableHandle] = []
        self._passes: PassLedger[_PassSquares] = PassLedger(new=_PassSquares, merge=_PassSquares.merged)
        self._held: dict[int, _Held] = {}  # pass id → its gradients not yet squared
        self._inputs: list[Optional[int]] = []  # dim 0 of the model's first tensor input, per forward pass since the pop
        self._leading: list[tuple[int, ...]] = []  # its first two dims, per forward pass since the pop
        #: Why the last step's given sizes may not be its passes' examples (:func:`_size_doubt`), for the meter to say
        self.size_doubt: Optional[str] = None

    def attach(self) -> None:
        self.detach()
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._handles = [p.register_hook(OwnHook(partial(self._on_grad, p))) for p in self._params]
        self._handles.append(self.model.register_forward_pre_hook(OwnHook(self._on_forward)))
        self._passes.watch(self._params)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._passes.unwatch()

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def call_at_pass_end(self, callback: Optional[Callable[[], None]]) -> None:
        """``callback()`` as each backward pass that fills a measured ``.grad`` ends (None: nothing)."""
        self._passes.on_end = callback

    def expect_batch_size(self, size: Optional[int]) -> None:
        """Unused: parameter hooks see whole micro-batch gradients (the size comes with :meth:`pop_into`)."""

    def measured_parameters(self) -> list[nn.Parameter]:
        return list(self._params)

    def left_out_parameters(self) -> list[nn.Parameter]:
        return []  # every trainable parameter is measured

    def coverage(self) -> Coverage:
        total = sum(p.numel() for p in self._params)
        return Coverage(measured_parameters=total, trainable_parameters=total)

    def _on_forward(self, _module: nn.Module, args: tuple) -> None:
        if self.enabled and not hooks_inert() and torch.is_grad_enabled():
            first = next((a for a in args if isinstance(a, torch.Tensor)), None)
            self._inputs.append(None if first is None or first.dim() == 0 else int(first.shape[0]))
            self._leading.append(() if first is None else tuple(first.shape[:2]))

    def _on_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        if not self.enabled or hooks_inert():
            return
        pass_id = self._passes.current()
        record = self._passes.record(pass_id)
        record.saw(param)
        if param.grad is None or grad.layout != torch.strided:  # to be adopted by .grad, or sparse: square it now
            record.parts.append(squared_norm(grad))
            return
        held = self._held.get(pass_id)
        if held is None:
            held = self._held[pass_id] = _Held()
            torch.autograd.Variable._execution_engine.queue_callback(partial(self._square_held, pass_id))
        held.add(grad)
        if held.bytes >= BUCKET_BYTES:
            self._square_held(pass_id, keep_open=True)

    def _square_held(self, pass_id: int, keep_open: bool = False) -> None:
        """``Σ |grad|²`` of the gradients held for ``pass_id`` (float32 accumulation, also for fp16/bf16), added
        to the pass's parts; ``keep_open``: mid-pass, more gradients of this pass follow."""
        held = self._held.pop(pass_id, None)
        if keep_open:
            self._held[pass_id] = _Held()
        if held is not None and held.grads:
            self._passes.record(pass_id).parts.append(squared_norm_sum(held.grads))

    def _square_all_held(self) -> None:
        """Passes whose end-of-pass callback never ran (a backward that raised): square what they left."""
        for pass_id in list(self._held):
            self._square_held(pass_id)

    def discard(self) -> None:
        """Drop every pass recorded since the last pop."""
        self._held.clear()
        self._passes.clear()
        self._inputs.clear()
        self._leading.clear()

    def pop(self) -> list[torch.Tensor]:
        """``Σ_p |grad_p|²`` of each committed backward pass since the last pop (device scalars, no sync)."""
        self._square_all_held()
        records = self._passes.pop()
        failure = next((r.failure for r in records if r.failure is not None), None)
        if failure is not None:
            raise RuntimeError(failure)
        return [torch.stack(r.parts).sum() if len(r.parts) > 1 else r.parts[0] for r in records if r.parts]

    def pop_into(
        self,
        window: AccumulationWindow,
        *,
        batch_sizes: Optional[Sequence[int]],
        loss_divisor: Optional[float],
        loss_reduction: LossReduction,
    ) -> int:
        """Add each committed pass to ``window`` as one unit of its micro-batch's size; returns the pass count."""
        passes, inputs, leading = self.pop(), self._inputs, self._leading
        self._inputs, self._leading = [], []
        if not passes:
            return 0
        sizes = _sizes_for(passes, batch_sizes, inputs)
        _check_step_size_given(batch_sizes, len(passes), inputs)
        self.size_doubt = _size_doubt(sizes, leading)
        divisor = float(loss_divisor or len(passes))
        for sq, b in zip(passes, sizes):
            factor = (divisor if loss_reduction == "mean" else divisor / b) ** 2
            window.add_micro_batch(sq, float(b), 1.0, b, weight=b * factor)
        return len(passes)


def _check_step_size_given(batch_sizes: Optional[Sequence[Optional[int]]], passes: int,
                           inputs: Sequence[Optional[int]]) -> None:
    """Raise where one size ``s`` was given for all ``passes`` but each pass's one forward pass took ``s/passes``
    examples in dim 0: the step's batch given as the micro-batch's, which reads ``B_simple`` ``passes`` times too
    high (4 passes of 8 given as 32: about 4×)."""
    if batch_sizes is None or len(batch_sizes) != 1 or passes < 2 or len(inputs) != passes:
        return
    seen = set(inputs)
    if len(seen) == 1 and None not in seen and batch_sizes[0] == passes * next(iter(seen)):
        size = next(iter(seen))
        raise RuntimeError(
            f"micro_batch_size={batch_sizes[0]} was given for each of the step's {passes} backward passes, but each "
            f"forward pass took {size} examples (dim 0 of the model's input): that is the step's batch, and B_simple "
            f"would read about {passes}× too high. Pass the examples of one backward pass: "
            f"meter.step(micro_batch_size={size})"
        )


def _size_doubt(sizes: Sequence[int], leading: Sequence[tuple[int, ...]]) -> Optional[str]:
    """Why the sizes given may not be the passes' examples, or None: each pass ran one forward pass, and the size
    given for it is neither dim 0 (batch first) nor dim 1 (sequence first) of the model's first tensor input. Rows
    that are not examples (positions flattened before the model) do that too, so this is said, not refused. Before,
    4 passes of 8 on the digits MLP given as 4 read B_simple = 32.8 (95% CI 28.9–37.7) against an exact 68.0, with
    nothing said (``benchmarks/plain_loops.py``)."""
    if len(leading) != len(sizes) or not all(leading):
        return None
    if any(size in dims for size, dims in zip(sizes, leading)):
        return None
    rows = leading[0][0]
    return (f"micro_batch_size={sizes[0] if len(set(sizes)) == 1 else list(sizes)} was given, but each forward pass "
            f"of the step took {rows} rows in dim 0 of the model's input (shape {list(leading[0])}, ...): if a row is "
            f"an example, B_simple reads about {rows / sizes[0]:.3g}× {'low' if rows > sizes[0] else 'high'}; pass the "
            f"examples of one backward pass, meter.step(micro_batch_size={rows}). Rows that are not examples "
            "(positions flattened before the model) are measured as given")


def _sizes_for(passes: Sequence[object], batch_sizes: Optional[Sequence[Optional[int]]],
               inputs: Sequence[Optional[int]] = ()) -> list[int]:
    """Each pass's examples, from ``batch_sizes`` (one for all, or one per pass); ``inputs``: dim 0 of the model's
    first tensor input at each forward pass of the step, named in the fix where a plain loop gave no size."""
    if batch_sizes is None:
        seen = set(inputs)
        shown = (f" (each forward pass of this step took {next(iter(seen))} examples in dim 0 of the model's input: "
                 f"meter.step(micro_batch_size={next(iter(seen))}) if that is one backward pass's batch)"
                 if len(seen) == 1 and None not in seen else "")
        raise RuntimeError(
            "method='micro_batch' needs the examples of each backward pass, and meter.step() was given none: pass "
            f"meter.step(micro_batch_size=...), an int for every pass or one per pass{shown}"
        )
    if not batch_sizes or None in batch_sizes:
        raise RuntimeError(
            "method='micro_batch' needs each micro-batch's size and it could not be read off the batch: the batch "
            "holds no tensor (e.g. raw strings tokenized in training_step), or its tensors' leading dims disagree "
            "with no majority. Let the DataLoader yield tensors with the batch as dim 0 (e.g. tokenize in a "
            "collate_fn), or use method='per_example', which reads the size off its layers (in a plain loop: pass "
            "micro_batch_size to meter.step)."
        )
    if len(batch_sizes) == 1:
        return list(batch_sizes) * len(passes)
    if len(batch_sizes) != len(passes):
        raise RuntimeError(
            f"micro_batch_size lists {len(batch_sizes)} sizes but {len(passes)} backward passes were measured: "
            "give one size per backward pass, or one int for all."
        )
    return [int(b) for b in batch_sizes]
