"""Values recorded per backward pass, kept only for the passes that produce the step's ``.grad``.

Hooks on parameters and layer outputs fire in *every* autograd pass that reaches them: the training step's
``loss.backward()``, but also ``torch.autograd.grad(...)`` inside ``training_step`` (a gradient penalty), in a
validation step run with gradients on, or in a user's own hooks. Only the passes that accumulate into
``.grad`` belong to the optimizer step being measured. :class:`PassLedger` keys each value by the autograd
engine's graph-task id and commits a pass when a parameter's ``.grad`` is accumulated during it
(``Tensor.register_post_accumulate_grad_hook``, which ``autograd.grad`` never fires). Torch only, no Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, Iterable, Optional, TypeVar

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
    """``pass id → value`` for the backward passes of one optimizer step; :meth:`pop` returns the committed ones."""

    _pending: dict[int, T] = field(default_factory=dict)
    _committed: list[int] = field(default_factory=list)
    _handles: list[RemovableHandle] = field(default_factory=list)

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
        pass_id = current_pass()
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
        self._pending.clear()
        self._committed.clear()
