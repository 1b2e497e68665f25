"""Which share of the trainable parameters a collector measures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Coverage:
    """Measured vs trainable parameter counts, and why the rest is left out (per parameter name)."""

    measured_parameters: int
    trainable_parameters: int
    excluded: dict[str, str] = field(default_factory=dict)

    @property
    def fraction(self) -> float:
        return self.measured_parameters / self.trainable_parameters if self.trainable_parameters else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured_parameters": self.measured_parameters,
            "trainable_parameters": self.trainable_parameters,
            "fraction": self.fraction,
            "excluded": dict(self.excluded),
            "uncovered": list(self.excluded),
        }
