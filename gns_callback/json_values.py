"""JSON-safe values: non-finite floats become ``None`` (``null``), recursively through dicts, lists and tuples.

Every report section goes through this: ``inf`` means "unbounded" and ``nan`` "not measured", neither of which
strict JSON can hold.
"""

from __future__ import annotations

import math
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (tuples become lists)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
