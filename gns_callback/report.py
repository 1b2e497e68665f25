"""The JSON report: ``{"estimate": ..., "run_estimate": ..., "config": ..., "run": ...}``.

It is how a user reads a result from ``strategy="ddp_spawn"`` (where the parent process's callback object is
not updated) and what later tools (plots, recommendations) read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gns_callback.estimate import GNSEstimate
from gns_callback.json_values import json_safe

REPORT_VERSION = 1
DEFAULT_REPORT_NAME = "gns_report.json"


def write_report(path: str | os.PathLike, sections: dict[str, Any]) -> Path:
    """Write ``sections`` atomically (temp file + rename) so a crash never leaves half a report; as strict JSON
    (:func:`~gns_callback.json_values.json_safe`: non-finite numbers as ``null``, numpy numbers as Python's)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = json_safe({"report_version": REPORT_VERSION, **sections})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    os.replace(tmp, path)
    return path


def read_report(path: str | os.PathLike) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def load_estimate(path: str | os.PathLike, section: str = "estimate") -> GNSEstimate:
    """The ``GNSEstimate`` stored in a report (``section="run_estimate"`` for the run average).

    Raises:
        ValueError: ``path`` holds no such section, or one without an estimate's fields (another file, or a report
            of another version), naming the file, the section and what it holds. Before, a bare ``KeyError``
            (``'estimate'``, ``'grad_sq_norm'``) or ``TypeError``.
    """
    report = read_report(path)
    hint = f"pass a {DEFAULT_REPORT_NAME} that GradientNoiseScaleCallback wrote"
    data = report.get(section) if isinstance(report, dict) else None
    if not isinstance(data, dict):
        held = [k for k, v in (report.items() if isinstance(report, dict) else ()) if isinstance(v, dict) and
                "b_simple" in v]
        raise ValueError(f"load_estimate({str(path)!r}, section={section!r}): the file has no such estimate section "
                         f"(estimate sections: {', '.join(held) or 'none'}); {hint}")
    try:
        return GNSEstimate.from_dict(data)
    except (KeyError, TypeError) as err:
        raise ValueError(f"load_estimate({str(path)!r}, section={section!r}): the section lacks an estimate's fields "
                         f"({err!r}): a report of another version, or not a report; {hint}") from None
