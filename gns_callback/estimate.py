"""The result a user reads: ``GNSEstimate`` (plain floats, ints and a string)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Optional

from gns_callback.json_values import json_safe, unmeasured
from gns_callback.smoothing import RatioSummary


@dataclass(frozen=True)
class GNSEstimate:
    """The simple gradient noise scale ``B_simple = tr(Σ)/|G|²`` with its confidence interval.

    Attributes:
        b_simple: ``trace_sigma/grad_sq_norm`` clamped to ``[0, ∞)``; ``inf`` while ``|G|²`` is not resolved,
            ``nan`` before any step was measured.
        grad_sq_norm: smoothed unbiased estimate of ``|G|²`` (squared norm of the true gradient).
        trace_sigma: smoothed unbiased estimate of ``tr(Σ)`` (per-example gradient covariance trace).
        ci_low, ci_high: Fieller interval at level ``confidence``; ``ci_high`` is ``inf`` when unbounded.
        steps: optimizer steps that contributed; skipped_steps: steps left out (non-finite gradients, e.g. a
            step the AMP GradScaler skipped, or nothing to compare). effective_steps: the smoothing's ``n_eff``.
        method: ``"micro_batch"`` or ``"per_example"``; averaging: ``"ema"`` (recent window) or ``"run"``.
        failure: why measuring stopped (then every value is ``nan``: "not measured"), else None.
    """

    b_simple: float
    grad_sq_norm: float
    trace_sigma: float
    ci_low: float
    ci_high: float
    confidence: float
    steps: int
    skipped_steps: int
    effective_steps: float
    method: str
    averaging: str
    failure: Optional[str] = None

    @classmethod
    def from_summary(
        cls, summary: RatioSummary, *, confidence: float, steps: int, skipped_steps: int, method: str, averaging: str
    ) -> "GNSEstimate":
        return cls(
            b_simple=summary.ratio,
            grad_sq_norm=summary.mean_y,
            trace_sigma=summary.mean_x,
            ci_low=summary.ci_low,
            ci_high=summary.ci_high,
            confidence=confidence,
            steps=steps,
            skipped_steps=skipped_steps,
            effective_steps=summary.effective_steps,
            method=method,
            averaging=averaging,
        )

    def not_measured(self, reason: str) -> "GNSEstimate":
        """This estimate withheld: no number the measurement can't vouch for, and the reason."""
        nan = math.nan
        return replace(self, b_simple=nan, grad_sq_norm=nan, trace_sigma=nan, ci_low=nan, ci_high=nan, failure=reason)

    @property
    def measured(self) -> bool:
        """Whether a value was measured (False before any step, or after measuring stopped)."""
        return self.failure is None and not math.isnan(self.b_simple)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: non-finite floats become ``None`` (``null``: unbounded or not measured)."""
        return json_safe(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GNSEstimate":
        """Inverse of :meth:`to_dict`: ``null`` → ``inf`` (unbounded) for ``b_simple`` of a measured estimate
        (:func:`unmeasured`) and for ``ci_high`` above a lower end, ``nan`` otherwise."""
        missing = {"b_simple": math.nan if unmeasured(data) else math.inf,
                   "ci_high": math.inf if data.get("ci_low") is not None else math.nan}
        values = {}
        for f in fields(cls):
            v = data.get("failure") if f.name == "failure" else data[f.name]  # absent in reports before "failure"
            if v is None and f.name != "failure":
                v = missing.get(f.name, math.nan)
            values[f.name] = v
        return cls(**values)

    def __str__(self) -> str:
        if self.failure is not None:
            return f"B_simple not measured ({self.failure})"
        if math.isnan(self.b_simple):
            why = "no optimizer step measured" if not self.steps else "no value"
            return f"B_simple not measured ({why}; {self.method})"
        level = round(100 * self.confidence)
        return (
            f"B_simple = {self.b_simple:.4g} ({level}% CI {self.ci_low:.4g} – {self.ci_high:.4g}; "
            f"|G|² = {self.grad_sq_norm:.4g}, tr(Σ) = {self.trace_sigma:.4g}; "
            f"{self.steps} steps, {self.skipped_steps} skipped; {self.method}, {self.averaging})"
        )
