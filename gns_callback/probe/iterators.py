"""Iterators a module keeps in its attributes: an iterator over another loader that ``training_step`` draws an
unlabelled batch from, a generator of loss weights. A pass of the step aside from the run (the probe's trials, the
per-example check, the sharpness monitor) advances them, and no copy can rewind an iterator.

So for those passes each such attribute is replaced by a :class:`ReplayIterator`, which records what it draws from
the original. Restoring rewinds it: the next pass sees the same values. When the passes are over it hands the
recorded values to the run, in order, and then puts the original object back. The run draws the same values in the
same order as it would without the passes.

Drawing from the original may draw from the global random streams too (a sampler's seed as a loader's epoch starts,
augmentation in an auxiliary loader without workers), which restoring then rewinds. So each value records the
streams' states before and after its draw (the generators the module keeps included: a loader's own ``generator``),
and where a replay finds the streams where the draw found them, it moves them on to where the draw left them: the
run's streams advance as without the passes. An iterator kept elsewhere (a
global, a data module) is not seen. Torch only, no Lightning.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from torch import Tensor, nn

from gns_callback.random_streams import RNGState, StreamStates

__all__ = ["ReplayIterator", "ReplayedIterators"]


class ReplayIterator:
    """Stands in for ``owner.<key>``, an iterator, while passes aside from the run draw from it (module docstring)."""

    # No __dict__: the attribute snapshot counts it by identity alone (probe/attributes.py).
    __slots__ = ("original", "owner", "key", "streams", "recorded", "draws", "position", "released")

    def __init__(self, original: Any, owner: nn.Module, key: str, streams: Optional["Streams"] = None) -> None:
        self.original, self.owner, self.key = original, owner, key
        self.streams = streams or Streams()
        self.recorded: list[Any] = []
        #: Per recorded value, where its draw drew from the global streams: their states before and after it.
        self.draws: list[Optional[tuple[StreamStates, RNGState]]] = []
        self.position = 0
        self.released = False

    def __iter__(self) -> "ReplayIterator":
        return self

    def __next__(self) -> Any:
        if self.position < len(self.recorded):
            return self._replay()
        if self.released:
            return next(self.original)
        before = self.streams.capture().fingerprint()
        try:
            item = next(self.original)
        except StopIteration:  # its end may draw too (a RandomSampler draws one more order as it ends)
            item = _END
        after = self.streams.capture()
        self.recorded.append(item)
        self.draws.append((before, after) if after.fingerprint() != before else None)
        self.position += 1
        return _value(item)

    def _replay(self) -> Any:
        """The next recorded value, the global streams moved on as its draw moved them (module docstring)."""
        item, draw = self.recorded[self.position], self.draws[self.position]
        self.position += 1
        if draw is not None and self.streams.capture().fingerprint() == draw[0]:
            draw[1].restore()
        if self.released and self.position == len(self.recorded):
            self._hand_back()
        return _value(item)

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
        self.recorded, self.draws, self.position = [], [], 0


_END = object()  # recorded where the original ended (raised StopIteration)


def _value(item: Any) -> Any:
    if item is _END:
        raise StopIteration
    return item


class Streams:
    """The random streams an iterator's draws may move: the global ones and the generators ``module`` keeps
    (:mod:`gns_callback.random_streams`; a DataLoader's ``generator`` draws its order at each epoch's start)."""

    def __init__(self, module: Optional[nn.Module] = None, skip: Iterable[str] = ()) -> None:
        self.module, self.skip = module, tuple(skip)

    def capture(self) -> RNGState:
        return RNGState(self.module, self.skip)


def _is_iterator(value: Any) -> bool:
    return hasattr(type(value), "__next__") and not isinstance(value, (nn.Module, Tensor, ReplayIterator))


def _pending(value: Any) -> bool:
    """A replay released by earlier passes whose recorded values the run has not drawn back yet."""
    return isinstance(value, ReplayIterator) and value.released and value.position < len(value.recorded)


def _rearmed(replay: ReplayIterator) -> ReplayIterator:
    """``replay`` (:func:`_pending`) recording again for new passes, from its first value not yet drawn back."""
    replay.recorded, replay.draws = replay.recorded[replay.position:], replay.draws[replay.position:]
    replay.position, replay.released = 0, False
    return replay


class ReplayedIterators:
    """Every iterator in the attributes of ``module`` and its submodules (except ``skip`` names) replaced by a
    :class:`ReplayIterator` from construction until :meth:`release`.

    A replay an earlier set released, still holding values the run has not drawn back (two sets of passes in a row
    on one batch: the per-example check, then the loss's reduction), is taken over as it is: its values come first,
    then new draws, and this set's :meth:`rewind` and :meth:`release` apply to it. Before, the second set's passes
    drew its values back for the run, the original came back in its place, and the rest of those passes drew from
    the original itself: the run then drew other values than without the passes."""

    def __init__(self, module: nn.Module, skip: Iterable[str] = ()) -> None:
        skipped = set(skip)
        streams = Streams(module, skipped)
        self.replays = [
            _rearmed(value) if isinstance(value, ReplayIterator) else ReplayIterator(value, sub, key, streams)
            for sub in module.modules() for key, value in list(vars(sub).items())
            if key not in skipped and (_is_iterator(value) or _pending(value))
        ]
        for replay in self.replays:
            vars(replay.owner)[replay.key] = replay

    def rewind(self) -> None:
        for replay in self.replays:
            replay.rewind()

    def release(self) -> None:
        for replay in self.replays:
            replay.release()
