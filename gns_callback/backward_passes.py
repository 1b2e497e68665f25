"""Values recorded per backward pass, kept only for the passes that produce the step's ``.grad``.

Hooks on parameters and layer outputs fire in *every* autograd pass that reaches them: the training step's
``loss.backward()``, but also ``torch.autograd.grad(...)`` inside ``training_step`` (a gradient penalty), in a
validation step run with gradients on, or in a user's own hooks. Only the passes that accumulate into
``.grad`` belong to the optimizer step being measured. :class:`PassLedger` keys each value by the autograd
engine's graph-task id and commits a pass when a parameter's ``.grad`` is accumulated during it
(``Tensor.register_post_accumulate_grad_hook``, which ``autograd.grad`` never fires). Torch only, no Lightning.

A backward pass started from inside another one's backward (reentrant gradient checkpointing,
``torch.utils.checkpoint(..., use_reentrant=True)``: the checkpointed segment's backward is a pass of its own, run by
the outer pass) is part of the outer pass: :meth:`PassLedger.pop` merges each committed pass into the pass it ran
inside. Counted apart, one micro-batch would read as two, each with part of the model. A nested pass that fills no
``.grad`` (``autograd.grad`` in a user's backward hook) is dropped like any other.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Generic, Iterable, Optional, TypeVar

import torch
from torch.utils.hooks import RemovableHandle

from gns_callback.own_hooks import OwnHook

T = TypeVar("T")


def current_pass() -> int:
    """The autograd engine's id of the backward pass running now (-1 outside backward)."""
    return int(torch._C._current_graph_task_id())


def in_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, ...) is running: hooks must stay inert there."""
    return torch._C._functorch.peek_interpreter_stack() is not None


_paused = 0  # open measurement_paused() contexts


@contextmanager
def measurement_paused() -> Iterator[None]:
    """Every meter's hooks in this process inert inside: the passes a probe or a check runs are no one's training
    step. (With two meters on one model, one's probe ran batches of 2 through the other's hooks, which then stopped
    measuring: "dim 0 does not hold the batch of 16".)"""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


def hooks_inert(pausable: bool = True) -> bool:
    """Whether measuring hooks must do nothing now: inside a ``torch.func`` transform, or (``pausable``) inside
    :func:`measurement_paused`."""
    return (pausable and _paused > 0) or in_functorch_transform()


def at_the_end_of_the_pass(callback: Callable[[], None]) -> None:
    """Call ``callback`` as the running backward pass ends, after what other code queued to run then during it
    (DDP's gradient reduction, which writes the reduced gradients into ``.grad``): queued by a callback queued now,
    it runs behind them. Call it from inside a backward pass."""
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queue(partial(queue, callback))


@dataclass
class PassLedger(Generic[T]):
    """``pass id → value`` for the backward passes of one optimizer step; :meth:`pop` returns the committed ones.

    ``new()``: the value of a pass with nothing recorded yet. ``merge(first, later)``: one value of two passes that
    are one (a checkpointed segment's and its outer pass's).
    """

    new: Callable[[], T]
    merge: Callable[[T, T], T]
    _pending: dict[int, T] = field(default_factory=dict)
    _committed: list[int] = field(default_factory=list)
    _handles: list[RemovableHandle] = field(default_factory=list)
    _outer: dict[int, int] = field(default_factory=dict)  # pass seen → the outermost pass it runs inside (or itself)
    _running: set[int] = field(default_factory=set)  # passes seen whose backward has not finished
    #: Called as each committed pass ends (:func:`at_the_end_of_the_pass`), once its ``.grad`` is final.
    on_end: Optional[Callable[[], None]] = None

    def current(self) -> int:
        """The autograd engine's id of the backward pass running now (-1 outside backward), placed among the
        passes seen (:meth:`_first_seen`)."""
        pass_id = current_pass()
        if pass_id >= 0 and pass_id not in self._outer:
            self._first_seen(pass_id)
        return pass_id

    def _first_seen(self, pass_id: int) -> None:
        """Place a pass seen for the first time. Graph-task ids grow with each ``backward`` call, and a pass runs on
        its calling thread from its call to its end, so a pass started while another one runs is inside it:

        * an older pass seen and still running: this one is inside it;
        * passes newer than this one, already seen: they ran inside this one, which reached no hook before them.
        """
        enclosing = [p for p in self._running if p < pass_id]
        outer = self._outer[max(enclosing)] if enclosing else pass_id
        if not enclosing:
            self._outer = {p: outer if o > pass_id else o for p, o in self._outer.items()}
        self._outer[pass_id] = outer
        self._running.add(pass_id)
        torch.autograd.Variable._execution_engine.queue_callback(partial(self._running.discard, pass_id))

    def watch(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Commit the running pass whenever one of ``params`` gets its ``.grad`` accumulated."""
        for p in params:
            self._handles.append(p.register_post_accumulate_grad_hook(OwnHook(self._on_accumulated)))

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    def _on_accumulated(self, _param: torch.Tensor) -> None:
        pass_id = self.current()
        if not self._committed or self._committed[-1] != pass_id:
            self._committed.append(pass_id)
            if self.on_end is not None:
                at_the_end_of_the_pass(self.on_end)

    def record(self, pass_id: int) -> T:
        """The value recorded for ``pass_id``, made by ``new()`` on first use."""
        value = self._pending.get(pass_id)
        if value is None:
            value = self._pending[pass_id] = self.new()
        return value

    def pop(self) -> list[T]:
        """Values of the committed passes, in order, each merged with the committed passes that ran inside it;
        everything else recorded since the last pop is dropped."""
        merged: dict[int, T] = {}
        for pass_id in dict.fromkeys(self._committed):
            if pass_id in self._pending:
                outer, value = self._outer.get(pass_id, pass_id), self._pending[pass_id]
                merged[outer] = self.merge(merged[outer], value) if outer in merged else value
        self.clear()
        return list(merged.values())

    def clear(self) -> None:
        """Forget every pass (called between optimizer steps, when no backward runs)."""
        self._pending.clear()
        self._committed.clear()
        self._outer.clear()
        self._running.clear()
