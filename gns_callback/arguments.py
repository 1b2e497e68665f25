"""Constructor arguments checked against a table: one :class:`Rule` per argument (pure Python, no Lightning).

Every bad value is refused where it is given, with a message that names the argument, shows the value, and gives a
valid example (``GradientNoiseScaleCallback(headroom='0.8'): must be a number in (0, 1], e.g. 0.85.``), not a bare
``TypeError`` or a silent misbehaviour late in training. ``bool`` is never accepted as a number (``True`` is an
``int`` in Python), and a number is never accepted as a ``bool`` switch (``probe="no"`` is truthy).
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union


@dataclass(frozen=True)
class Rule:
    """``check(value) -> bool`` and what a valid value is (completes "must be ...", with an example); ``expects``
    may also be a function of the refused value, for checks whose explanation depends on it."""

    check: Callable[[Any], bool]
    expects: Union[str, Callable[[Any], str]]

    def message(self, owner: str, name: str, value: Any) -> str:
        expects = self.expects(value) if callable(self.expects) else self.expects
        return f"{owner}({name}={value!r}): must be {expects}."


def is_number(value: Any) -> bool:
    """A real, finite number that is not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def int_at_least(low: int) -> Callable[[Any], bool]:
    return lambda value: is_int(value) and value >= low


def number_in(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not is_number(value):
            return False
        above = value > low if low_open else value >= low
        below = value < high if high_open else value <= high
        return above and below

    return check


def optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def one_of(*choices: Any) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, (str, type(None))) and value in choices


def is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def whole_bytes(value: Any) -> bool:
    """A positive whole number of bytes (``2e9`` is fine, ``0.5`` and ``"1GB"`` are not)."""
    return is_number(value) and value >= 1 and float(value).is_integer()


def report_path_problem(path: Any) -> Optional[str]:
    """Why the JSON report could not be written to ``path`` (None: it can) (nothing is left behind).

    The report is written at fit end, after the whole run: a path that can't take it must be refused up front.
    Missing parent folders are fine (they are created), as long as the nearest existing one is writable (checked
    by creating and removing a scratch file there).
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        return "a file path (str or os.PathLike)"
    target = Path(path)
    if target.is_dir():
        return "a file path, not an existing directory (e.g. 'runs/gns_report.json')"
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f"a path whose folder can be created ({folder} is a file)"
    try:  # os.access is not enough (root, read-only mounts): create and remove a scratch file there
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return f"a path in a folder you can write to ({folder} is not writable: {error.strerror or error})"
    if target.exists() and not os.access(target, os.W_OK):
        return "a path you can write to (the existing file is read-only)"
    return None


def builtin(value: Any) -> Any:
    """``value`` as Python's own ``int`` or ``float`` where it is another type of number (``numpy.int64(2)`` → 2),
    so that the checks, arithmetic and JSON report downstream see one type; anything else unchanged."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)


def check_arguments(owner: str, values: Mapping[str, Any], rules: Mapping[str, Rule]) -> None:
    """Raise ``ValueError`` for the first of ``values`` that its rule in ``rules`` refuses."""
    for name, value in values.items():
        rule = rules[name]
        if not rule.check(value):
            raise ValueError(rule.message(owner, name, value))


def positive_int_option(text: str) -> int:
    """A command-line option's positive integer (an ``argparse`` ``type=``: its error names the option)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def positive_float_option(text: str) -> float:
    """A command-line option's positive, finite number (an ``argparse`` ``type=``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


__all__ = ["Rule", "builtin", "check_arguments", "positive_float_option", "positive_int_option",
           "report_path_problem"]
