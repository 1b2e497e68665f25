"""Whether a training step draws random numbers of its own: ``F.dropout``, stochastic depth, noise injection, random
masks, augmentation on the device. No module type shows these, and each makes an example's gradient differ from one
draw to the next (:mod:`gns_callback.sampling`).

:class:`RandomDrawWatch` reads the state of every random stream the step may draw from before its forward pass, and
again before its backward pass: a stream that moved was drawn from. The streams are torch's CPU generator, the
current CUDA device's, numpy's and Python's global generators, and the generators a module keeps in its attributes
(a ``torch.Generator``, a numpy ``Generator`` or ``RandomState``, a ``random.Random``). Reading a state never
advances it, and nothing runs twice: the run is left exactly as it was, whatever the step does with state of its
own (an iterator over another loader, a counter). A generator kept elsewhere (a global of the user's module,
another accelerator's) is not seen. The Lightning callback reads the first step's window so; a loop of one's own
shows the meter its steps only, and :class:`StepDrawWatch` reads the windows between them, with the generators the
loop keeps in its own scope (:func:`scope_generators`: a script's ``rng = np.random.default_rng()`` drawing the
noise of its augmentation). Torch only, no Lightning.
"""

from __future__ import annotations

import inspect
import random
import sys
from collections.abc import Hashable, Iterator
from itertools import islice
from types import FrameType, ModuleType
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch
from torch import nn

__all__ = ["GENERATOR_TYPES", "RNGState", "RandomDrawWatch", "StepDrawWatch", "attribute_objects", "caller_frames",
           "drawn_reason", "generator_state", "module_generators", "moved", "scope_generators", "scope_objects",
           "set_generator_state", "stream_states"]

StreamStates = dict[str, Hashable]


GENERATOR_TYPES = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)


def stream_states(module: Optional[nn.Module] = None, skip: Iterable[str] = (),
                  extra: Iterable[tuple[str, Any]] = ()) -> StreamStates:
    """Each random stream's state, by name (module docstring); ``extra``: more ``(name, generator)`` pairs."""
    return RNGState(module, skip, extra).fingerprint()


def module_generators(module: Optional[nn.Module], skip: Iterable[str] = ()) -> list[tuple[str, Any]]:
    """``(name, generator)`` for each generator object the attributes of ``module`` and its submodules hold, directly
    or inside dicts, lists, tuples and plain objects (a helper that augments, a DataLoader's ``generator``), up to
    :data:`_DEPTH` levels down; ``skip``: attribute names left alone (a framework's internals)."""
    return attribute_objects(module, _is_generator, skip)


def attribute_objects(module: Optional[nn.Module], wanted: Callable[[Any], bool], skip: Iterable[str] = (),
                      stop: Iterable[Any] = ()) -> list[tuple[str, Any]]:
    """``(name, object)`` for each object ``wanted`` accepts that the attributes of ``module`` and its submodules
    hold, directly or inside dicts, lists, tuples and plain objects, up to :data:`_DEPTH` levels down and
    :data:`_ITEMS` entries a container (a bounded walk: a data set held as a list is not read through). Modules,
    tensors and the ``stop`` objects (a Trainer) are not walked into; ``skip``: attribute names left alone."""
    found: dict[int, tuple[str, Any]] = {}
    seen: set[int] = {id(obj) for obj in stop}
    skipped = set(skip) | TORCH_INTERNALS
    for prefix, sub in (module.named_modules() if module is not None else ()):
        for key, value in vars(sub).items():
            if key not in skipped:
                _find(value, f"{prefix}.{key}" if prefix else key, 0, wanted, found, seen)
    return list(found.values())


def scope_generators(frames: Iterable[FrameType]) -> list[tuple[str, Any]]:
    """``(name, generator)`` for each generator a loop keeps in its own scope: in the local variables of
    ``frames`` (and in the objects, dicts and lists they hold, a few levels down) and, directly, in their global
    variables. A script's ``rng = np.random.default_rng()`` that draws the noise of its augmentation is one."""
    return [(f"loop:{name}", value) for name, value in scope_objects(frames, _is_generator)]


def scope_objects(frames: Iterable[FrameType], wanted: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """``(name, object)`` for each ``wanted`` object a loop keeps in its own scope: in the local variables of
    ``frames`` (and in the objects, dicts and lists they hold, two levels down: ``self.loader``) and, directly, in
    their global variables."""
    found: dict[int, tuple[str, Any]] = {}
    seen: set[int] = set()
    for frame in frames:
        for key, value in frame.f_locals.items():
            _find(value, key, _DEPTH - 2, wanted, found, seen)
        for key, value in frame.f_globals.items():
            if wanted(value):
                found.setdefault(id(value), (key, value))
    return list(found.values())


def caller_frames(levels: int, above: int = 1) -> list[FrameType]:
    """The ``levels`` frames above the caller's, ``above`` levels up, innermost first (fewer near the stack's top)."""
    frame, frames = sys._getframe(above + 1), []
    while frame is not None and len(frames) < levels:
        frames.append(frame)
        frame = frame.f_back
    return frames


_DEPTH = 4
_MAX_SEEN = 20_000
_ITEMS = 256  # entries of one container looked at
_ATOMS = (str, bytes, int, float, complex, bool, type(None))
#: ``nn.Module``'s own ``__dict__`` entries (registries, hooks, ``training``).
TORCH_INTERNALS = frozenset(vars(nn.Module()))


def _is_generator(value: Any) -> bool:
    return isinstance(value, GENERATOR_TYPES)


def _find(value: Any, name: str, depth: int, wanted: Callable[[Any], bool], found: dict[int, tuple[str, Any]],
          seen: set[int]) -> None:
    if wanted(value):
        found.setdefault(id(value), (name, value))
        return
    if (depth >= _DEPTH or id(value) in seen or len(seen) > _MAX_SEEN or isinstance(value, _ATOMS)
            or isinstance(value, (nn.Module, torch.Tensor, ModuleType))):
        return
    seen.add(id(value))
    for item_name, item in _items(value, name):
        _find(item, item_name, depth + 1, wanted, found, seen)


def _items(value: Any, name: str) -> Iterator[tuple[str, Any]]:
    """The first :data:`_ITEMS` entries of a dict, list or tuple, or an object's attributes, with their names (a
    data set held as a list of a million strings is not walked)."""
    if isinstance(value, dict):
        entries: Iterable[tuple[Any, Any]] = value.items()
        named = "{}[{!r}]"
    elif isinstance(value, (list, tuple)):
        entries, named = enumerate(value), "{}[{}]"
    elif hasattr(value, "__dict__") and not isinstance(value, type) and not inspect.isroutine(value):
        entries, named = vars(value).items(), "{}.{}"
    else:
        return
    for key, item in islice(entries, _ITEMS):
        yield named.format(name, key), item


def generator_state(generator: Any) -> Any:
    """A generator object's state, as its own setter takes it back (:func:`set_generator_state`)."""
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    if isinstance(generator, np.random.Generator):
        return generator.bit_generator.state
    return generator.getstate() if isinstance(generator, random.Random) else generator.get_state()


def set_generator_state(generator: Any, state: Any) -> None:
    if isinstance(generator, torch.Generator):
        generator.set_state(state)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = state
    elif isinstance(generator, random.Random):
        generator.setstate(state)
    else:
        generator.set_state(state)


class RNGState:
    """torch (CPU and every initialised CUDA device), numpy and Python ``random`` generator states, and those of
    the generators ``module`` keeps in its attributes (:func:`module_generators`): :meth:`restore` puts them back,
    :meth:`fingerprint` compares them."""

    def __init__(self, module: Optional[nn.Module] = None, skip: Iterable[str] = (),
                 extra: Iterable[tuple[str, Any]] = ()) -> None:
        generators = {id(gen): (name, gen) for name, gen in [*module_generators(module, skip), *extra]}
        self.generators = [(name, gen, generator_state(gen)) for name, gen in generators.values()]
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.numpy = np.random.get_state()
        self.python = random.getstate()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)
        for _, gen, state in self.generators:
            set_generator_state(gen, state)

    def fingerprint(self) -> StreamStates:
        """Each stream's state by name, hashable; of CUDA, the current device's only (each rank's own)."""
        states: StreamStates = {"torch": _hashable(self.torch), "numpy": _hashable(self.numpy), "random": self.python}
        if self.cuda is not None:
            states[f"cuda:{torch.cuda.current_device()}"] = _hashable(self.cuda[torch.cuda.current_device()])
        states.update({name: _hashable(state) for name, _, state in self.generators})
        return states


def _hashable(state: Any) -> Hashable:
    """A state as nested tuples and bytes (numpy's are tuples or dicts holding arrays; torch's a byte tensor)."""
    if isinstance(state, torch.Tensor):
        return state.numpy().tobytes()
    if isinstance(state, np.ndarray):
        return state.tobytes()
    if isinstance(state, dict):
        return tuple((key, _hashable(value)) for key, value in state.items())
    if isinstance(state, (tuple, list)):
        return tuple(_hashable(item) for item in state)
    return state


def moved(before: StreamStates, after: StreamStates) -> list[str]:
    """The streams whose state differs between two readings (a stream in one reading only counts as moved)."""
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


class RandomDrawWatch:
    """``start()`` before a step's forward pass, ``stop()`` before its backward pass: the streams drawn from in
    between (module docstring). ``module``: the model, whose attributes may hold generators of its own."""

    def __init__(self, module: Optional[nn.Module] = None, skip: Iterable[str] = ()) -> None:
        self.module = module
        self.skip = tuple(skip)
        self._before: Optional[StreamStates] = None

    def start(self, extra: Iterable[tuple[str, Any]] = ()) -> None:
        """``extra``: more ``(name, generator)`` pairs to read (:func:`scope_generators`)."""
        self._before = stream_states(self.module, self.skip, extra)

    def stop(self, extra: Iterable[tuple[str, Any]] = ()) -> Optional[list[str]]:
        """The names of the streams drawn from since :meth:`start` (empty: none); None if not started."""
        if self._before is None:
            return None
        drawn, self._before = moved(self._before, stream_states(self.module, self.skip, extra)), None
        return drawn


class StepDrawWatch:
    """For a loop of one's own, where only the optimizer steps are seen: ``tick()`` at each step reads the streams
    and compares them with the previous step's reading. The window between two steps holds the forward pass, but
    also the data loader's next batch: a shuffling sampler draws an epoch's order from torch's stream as the epoch
    starts. So the step counts as drawing random numbers of its own only if the streams moved in each of
    ``windows`` windows in a row, which one epoch start can't do unless epochs are that short."""

    def __init__(self, module: Optional[nn.Module] = None, windows: int = 2) -> None:
        self.watch = RandomDrawWatch(module)
        self.windows = windows
        self.drawn: list[list[str]] = []  # the streams that moved, window by window

    def tick(self, extra: Iterable[tuple[str, Any]] = ()) -> Optional[list[str]]:
        """None until ``windows`` windows are seen; then the streams drawn from in every one of them (empty: the
        step draws none). ``extra``: the loop's own generators (:func:`scope_generators`)."""
        extra = list(extra)
        drawn = self.watch.stop(extra)
        self.watch.start(extra)
        if drawn is not None:
            self.drawn.append(drawn)
        if len(self.drawn) < self.windows:
            return None
        return sorted(set.intersection(*(set(d) for d in self.drawn)))


def drawn_reason(streams: list[str]) -> str:
    """Why the draws vary, for a report: the step drew from ``streams``."""
    return (f"the training step drew random numbers ({', '.join(streams)}): dropout by function, stochastic depth, "
            "noise or random masks make an example's gradient differ from one draw to the next")
