"""Values recorded per backward pass, kept only for the passes that produce the step's ``.grad``.

Hooks on parameters and layer outputs fire in *every* autograd pass that reaches them: the training step's
``loss.backward()``, but also ``torch.autograd.grad(...)`` inside ``training_step`` (a gradient penalty), in a
validation step run with gradients on, or in a user's own hooks. Only the passes that accumulate into
``.grad`` belong to the optimizer step being measured. :class:`PassLedger` keys each value by the autograd
engine's graph-task id and commits a pass when a parameter's ``.grad`` is accumulated during it
(``Tensor.register_post_accumulate_grad_hook``, which ``autograd.grad`` never fires). Torch only, no Lightning.

A backward pass started from inside another one's backward (reentrant gradient checkpointing,
``torch.utils.checkpoint(..., use_reentrant=True)``: the checkpointed segment's backward is a pass of its own, run by
the outer pass) is part of the outer pass: its layers and parameters are recorded under the outer pass's id
(:meth:`PassLedger.current`). Counted apart, one micro-batch would read as two, each with part of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Generic, Iterable, Optional, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

T = TypeVar("T")


def current_pass() -> int:
    """The autograd engine's id of the backward pass running now (-1 outside backward)."""
    return int(torch._C._current_graph_task_id())


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, ...) is running: hooks must stay inert there."""
    return torch._C._functorch.peek_interpreter_stack() is not None


@dataclass
class PassLedger(Generic[T]):
    """``pass id → value`` for the backward passes of one optimizer step; :meth:`pop` returns the committed ones.

    ``merge(outer, inner)``: one value of two recorded apart for what turned out to be one pass (a checkpointed
    segment that ran before the outer pass reached any hook).
    """

    merge: Callable[[T, T], T]
    _pending: dict[int, T] = field(default_factory=dict)
    _committed: list[int] = field(default_factory=list)
    _handles: list[RemovableHandle] = field(default_factory=list)
    _outer: dict[int, int] = field(default_factory=dict)  # pass seen → the outermost pass it runs inside (or itself)
    _running: set[int] = field(default_factory=set)  # passes seen whose backward has not finished

    def current(self) -> int:
        """The id the running backward pass is recorded under: its own, or that of the pass whose backward runs it
        (-1 outside backward)."""
        pass_id = current_pass()
        if pass_id < 0:
            return pass_id
        outer = self._outer.get(pass_id)
        return outer if outer is not None else self._first_seen(pass_id)

    def _first_seen(self, pass_id: int) -> int:
        """Place a pass seen for the first time. Graph-task ids grow with each ``backward`` call, and a pass runs on
        its calling thread from its call to its end, so a pass started while another one runs is inside it:

        * an older pass seen and still running: this one is inside it;
        * passes newer than this one, already seen: they ran inside this one, which reached no hook before them.
        """
        enclosing = [p for p in self._running if p < pass_id]
        if enclosing:
            outer = self._outer[max(enclosing)]
        else:
            outer = pass_id
            for inner in sorted(p for p, o in self._outer.items() if p > pass_id and o == p):
                self._move(inner, outer)
        self._outer[pass_id] = outer
        self._running.add(pass_id)
        torch.autograd.Variable._execution_engine.queue_callback(partial(self._running.discard, pass_id))
        return outer

    def _move(self, inner: int, outer: int) -> None:
        """Record under ``outer`` what was recorded under ``inner`` and the passes inside it."""
        self._outer = {p: outer if o == inner else o for p, o in self._outer.items()}
        self._committed = [outer if c == inner else c for c in self._committed]
        if inner in self._pending:
            moved = self._pending.pop(inner)
            self._pending[outer] = self.merge(self._pending[outer], moved) if outer in self._pending else moved

    def watch(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Commit the running pass whenever one of ``params`` gets its ``.grad`` accumulated."""
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_accumulated))

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    def _on_accumulated(self, _param: torch.Tensor) -> None:
        pass_id = self.current()
        if not self._committed or self._committed[-1] != pass_id:
            self._committed.append(pass_id)

    def get(self, pass_id: int) -> Optional[T]:
        return self._pending.get(pass_id)

    def put(self, pass_id: int, value: T) -> None:
        self._pending[pass_id] = value

    def pop(self) -> list[T]:
        """Values of the committed passes, in order; everything else recorded since the last pop is dropped."""
        values = [self._pending[i] for i in dict.fromkeys(self._committed) if i in self._pending]
        self.clear()
        return values

    def clear(self) -> None:
        """Forget every pass (called between optimizer steps, when no backward runs)."""
        self._pending.clear()
        self._committed.clear()
        self._outer.clear()
        self._running.clear()
