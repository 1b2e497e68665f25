"""Steps left out because their gradient overflowed (an AMP GradScaler's skipped steps), and when that leaves the
estimate biased.

A GradScaler skips a step whose gradient holds inf or NaN, and the meter leaves it out. While the scale is still too
large every batch overflows, whatever its examples, and leaving those out costs nothing but steps. Once one batch
has fitted, a later one overflows only where its gradient is larger than the scale allows: the steps left out are
then the batches with the largest gradients, and the rest read ``|G|²`` low and ``B_simple`` high. By how much
depends on the tails of the batch gradient: with the top share ``q`` of batches by largest gradient element left
out (exact per-example gradients, ``python benchmarks/overflow_censoring.py``), ``q = 1%`` read 1.02× the exact value
on a digits MLP and 1.23× on a breast-cancer MLP, ``q = 5%`` 1.07× and 1.89×. A GradScaler at its defaults doubles
its scale every 2,000 steps and so overflows about one step in 2,000 (0.05%).

:class:`OverflowCount` counts the steps after the first finite one, and those of them that overflowed. Above
:data:`MAX_SHARE` of them (and at least :data:`MIN_OVERFLOWS`) the estimate is withheld, with the reason and the fix,
for as long as the share stays above it. Torch-free, no Lightning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

__all__ = ["MAX_SHARE", "MIN_OVERFLOWS", "OverflowCount"]

#: Largest share of the steps after the first finite one that may overflow (at 0.5% the breast-cancer MLP read 1.14×).
MAX_SHARE = 0.002
#: Fewest overflowed steps that withhold the estimate (one or two while a fresh scaler settles are expected).
MIN_OVERFLOWS = 3


@dataclass
class OverflowCount:
    """``settled``: steps from the first one with a finite gradient on; ``overflowed``: those of them whose gradient
    was not finite; ``scaled``: a loss scale was given (an AMP GradScaler is in use). Without one, non-finite
    gradients are no scaler's skipped steps but a run that diverged, and the reason says so."""

    settled: int = 0
    overflowed: int = 0
    scaled: bool = False

    def update(self, finite: bool) -> None:
        """Count one optimizer step, ``finite`` where its gradient was."""
        if finite or self.settled:
            self.settled += 1
            self.overflowed += not finite

    def problem(self) -> Optional[str]:
        """Why the estimate can't be trusted now, or None."""
        if self.overflowed < MIN_OVERFLOWS or self.overflowed <= MAX_SHARE * self.settled:
            return None
        if not self.scaled:
            return (
                f"{self.overflowed} of the {self.settled} steps since the first finite gradient had non-finite "
                "gradients (inf or NaN) with no AMP loss scale in use, so no GradScaler skipped them: the run diverged "
                "or a batch gave NaN (a learning rate too high, a NaN in the data or the loss). Leaving out more than "
                f"{MAX_SHARE:.1%} of the steps reads B_simple too high. Lower the learning rate or clip the gradients "
                "(with a GradScaler of your own, pass its scale: meter.step(loss_scale=...)); the estimate returns "
                "once the share falls"
            )
        return (
            f"{self.overflowed} of the {self.settled} steps since the first finite gradient overflowed (non-finite "
            f"gradients, skipped by the AMP GradScaler): those are the batches with the largest gradients, and "
            f"leaving out more than {MAX_SHARE:.1%} of them reads B_simple too high (on a breast-cancer MLP, 1% left "
            "out read 1.23x the exact value). Let the scaler grow its scale less often (GradScaler(growth_interval="
            "2000), its default), lower a fixed scale, or train in bf16; the estimate returns once the share falls"
        )

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.settled, self.overflowed = int(state["settled"]), int(state["overflowed"])
        self.scaled = bool(state.get("scaled", True))  # absent before this key existed: counted under a scaler
