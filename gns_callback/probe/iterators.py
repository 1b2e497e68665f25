"""Iterators a module keeps in its attributes: an iterator over another loader that ``training_step`` draws an
unlabelled batch from, a generator of loss weights. A pass of the step aside from the run (the probe's trials, the
per-example check, the sharpness monitor) advances them, and no copy can rewind an iterator.

So for those passes each such attribute is replaced by a :class:`ReplayIterator`, which records what it draws from
the original. Restoring rewinds it: the next pass sees the same values. When the passes are over it hands the
recorded values to the run, in order, and then puts the original object back. The run draws the same values in the
same order as it would without the passes.

An iterator kept elsewhere (a global, a data module) is not seen, and neither are random numbers its original draws
in the main process while the passes advance it (augmentation in an auxiliary loader without workers). Torch only,
no Lightning.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import Tensor, nn

__all__ = ["ReplayIterator", "ReplayedIterators"]


class ReplayIterator:
    """Stands in for ``owner.<key>``, an iterator, while passes aside from the run draw from it (module docstring)."""

    # No __dict__: the attribute snapshot counts it by identity alone (probe/attributes.py).
    __slots__ = ("original", "owner", "key", "recorded", "position", "released")

    def __init__(self, original: Any, owner: nn.Module, key: str) -> None:
        self.original, self.owner, self.key = original, owner, key
        self.recorded: list[Any] = []
        self.position = 0
        self.released = False

    def __iter__(self) -> "ReplayIterator":
        return self

    def __next__(self) -> Any:
        if self.position < len(self.recorded):
            item = self.recorded[self.position]
            self.position += 1
            if self.released and self.position == len(self.recorded):
                self._hand_back()
            return item
        item = next(self.original)
        if not self.released:
            self.recorded.append(item)
            self.position += 1
        return item

    def __getattr__(self, name: str) -> Any:
        if name in ReplayIterator.__slots__ or name.startswith("__"):  # not set yet; or ``__dict__``, which it has not
            raise AttributeError(name)
        return getattr(self.original, name)

    def rewind(self) -> None:
        """Back to the first recorded value: what the passes drew is drawn again."""
        self.position = 0

    def release(self) -> None:
        """The passes are over: the run gets the recorded values, then the original object back in its place."""
        self.position, self.released = 0, True
        if not self.recorded:
            self._hand_back()

    def _hand_back(self) -> None:
        if vars(self.owner).get(self.key) is self:
            vars(self.owner)[self.key] = self.original
        self.recorded, self.position = [], 0


def _is_iterator(value: Any) -> bool:
    return hasattr(type(value), "__next__") and not isinstance(value, (nn.Module, Tensor, ReplayIterator))


class ReplayedIterators:
    """Every iterator in the attributes of ``module`` and its submodules (except ``skip`` names) replaced by a
    :class:`ReplayIterator` from construction until :meth:`release`."""

    def __init__(self, module: nn.Module, skip: Iterable[str] = ()) -> None:
        skipped = set(skip)
        self.replays = [
            ReplayIterator(value, sub, key)
            for sub in module.modules() for key, value in list(vars(sub).items())
            if key not in skipped and _is_iterator(value)
        ]
        for replay in self.replays:
            vars(replay.owner)[replay.key] = replay

    def rewind(self) -> None:
        for replay in self.replays:
            replay.rewind()

    def release(self) -> None:
        for replay in self.replays:
            replay.release()
