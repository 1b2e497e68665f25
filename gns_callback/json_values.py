"""JSON-safe values: non-finite floats become ``None`` (``null``), recursively through dicts, lists and tuples.

Every report section goes through this: ``inf`` means "unbounded" and ``nan`` "not measured", neither of which
strict JSON can hold. Numbers of other types that the constructor's checks accept (numpy's ``int64``, ``float32``:
any ``numbers.Integral`` or ``numbers.Real``) become Python's ``int`` and ``float``, which ``json`` can write.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None``, other numbers as ``int``/``float`` (tuples become
    lists). Before, a numpy ``max_batch_size=np.int64(512)``, accepted as an integer, reached the report as is, and
    ``json`` raised ``TypeError`` at fit end: the finished fit failed."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def unmeasured(data: Mapping[str, Any]) -> bool:
    """Whether a JSON estimate (a report's ``estimate``, ``run_estimate``, ``batch_target`` or a ``history`` row) holds
    no measured value, where JSON writes "not measured" and "unbounded" alike as ``null``: a ``failure`` given, no
    step measured, or ``b_simple`` and ``ci_low`` both ``null`` (an unbounded interval has a lower end). Before, a
    fit that measured no step, or one that stopped measuring, read back as ``b_simple = inf``: unbounded."""
    get = data.get
    if get("failure") is not None or get("steps") == 0:
        return True
    return get("b_simple") is None and get("ci_low") is None
