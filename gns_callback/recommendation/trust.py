"""Can a batch size be based on this estimate? The estimate as :func:`recommend` reads it, and its verdict.

An estimate is trusted when something was measured over enough steps and its confidence interval is bounded and
narrow (``ci_high/ci_low ≤ max_ci_ratio``). A trusted estimate whose interval already holds the current batch
keeps it: McCandlish et al.'s trade-off is flat near the knee ``B = B_noise``, so a move inside the interval
buys nothing the measurement can resolve.

A wide or unbounded interval that lies wholly on one side of the current batch still says which way to go:
``toward_interval`` moves the batch to the interval's near end (``ci_high`` when the current batch is above it,
``ci_low`` when below), the smallest move every value in the interval agrees with. From a batch far above the
knee, a short run at large batch measures few steps and its interval is wide, yet it lies far below the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from gns_callback.json_values import unmeasured
from gns_callback.recommendation import result as R

DEFAULT_MAX_CI_RATIO = 4.0
DEFAULT_MIN_STEPS = 20


@dataclass(frozen=True)
class EstimateView:
    """The fields of a noise-scale estimate that a recommendation uses.

    ``b_simple``/``ci_high`` are ``inf`` when unbounded (JSON ``null`` after steps were measured), ``nan`` when
    nothing was measured; ``steps`` is ``None`` when not given (not checked).
    """

    b_simple: float
    ci_low: float
    ci_high: float
    steps: Optional[int]
    confidence: float = 0.95
    averaging: str = "unknown"
    lr_noise_scale: float = math.nan  # the early phase's noise scale, for an SGD LR transfer (nan: not given)
    lr_noise_scale_low: float = math.nan  # the lower end of its interval (nan: not given)


NO_ESTIMATE = EstimateView(math.nan, math.nan, math.nan, 0, 0.95, "none")


def read_estimate(estimate: Any) -> EstimateView:
    """A :class:`EstimateView` from a ``GNSEstimate``, its ``to_dict()``, a duck with the same names, or ``None``.

    ``None`` (JSON ``null``) reads as in ``GNSEstimate.from_dict``: unbounded (``inf``) for ``b_simple`` and
    ``ci_high`` of a measured estimate, unknown (``nan``) where :func:`~gns_callback.json_values.unmeasured` (a
    ``failure``, no step, or ``b_simple`` and ``ci_low`` both ``null``: a report of a run that stopped measuring read
    "unbounded" before).
    """
    if estimate is None:
        return NO_ESTIMATE

    def get(name: str) -> Any:
        return estimate.get(name) if isinstance(estimate, Mapping) else getattr(estimate, name, None)

    steps = get("steps")
    steps = None if steps is None else int(steps)
    b, lo, hi = get("b_simple"), get("ci_low"), get("ci_high")
    fields = {"failure": get("failure"), "steps": steps, "b_simple": b, "ci_low": lo}
    unbounded = math.nan if unmeasured(fields) else math.inf
    b = unbounded if b is None else float(b)
    return EstimateView(
        b_simple=b,
        ci_low=math.nan if lo is None else float(lo),
        ci_high=(unbounded if not math.isnan(b) else math.nan) if hi is None else float(hi),
        steps=steps,
        confidence=float(get("confidence") or 0.95),
        averaging=str(get("averaging") or "unknown"),
        lr_noise_scale=_number(get("lr_noise_scale")),
        lr_noise_scale_low=_number(get("lr_noise_scale_low")),
    )


def _number(value: Any) -> float:
    """``value`` as a float; ``None`` (absent, or JSON ``null``) as ``nan``."""
    return math.nan if value is None else float(value)


def assess(
    b_simple: float,
    ci_low: float,
    ci_high: float,
    steps: Optional[int],
    *,
    max_ci_ratio: float = DEFAULT_MAX_CI_RATIO,
    min_steps: int = DEFAULT_MIN_STEPS,
) -> tuple[str, str]:
    """``(status, reason)`` for an estimate: can a batch size be based on it? (``steps=None``: not checked.)"""
    if math.isnan(b_simple) or steps == 0:
        return R.NO_ESTIMATE, "no gradient noise scale was measured: keeping the current batch size"
    if steps is not None and steps < min_steps:
        return R.TOO_FEW_STEPS, (
            f"only {steps} measured steps (< {min_steps}): keeping the current batch size; measure longer"
        )
    if math.isinf(b_simple) or not math.isfinite(ci_high):
        return R.UNBOUNDED, _unbounded_reason(ci_low)
    ratio = ci_high / ci_low if ci_low > 0 else math.inf
    if not ratio <= max_ci_ratio:
        return R.TOO_WIDE, (
            f"the interval is too wide to trust (ci_high/ci_low = {ratio:.3g} > {max_ci_ratio:g}): keeping the "
            "current batch size; measure over more steps"
        )
    return R.OK, (
        f"B_simple is resolved (ci_high/ci_low = {ratio:.3g} ≤ {max_ci_ratio:g}): recommending B ≈ B_simple, the "
        "knee where S/S_min = E/E_min = 2"
    )


def _unbounded_reason(ci_low: float) -> str:
    hint = ""
    if math.isfinite(ci_low) and ci_low > 0:
        hint = f" (B_noise is at least {ci_low:.4g}, the interval's lower bound)"
    return (
        "the interval is unbounded above (|G|² not resolved from the noise): keeping the current batch "
        f"size; measure over more steps{hint}"
    )


def verdict(
    est: EstimateView,
    current_batch_size: int,
    *,
    max_ci_ratio: float = DEFAULT_MAX_CI_RATIO,
    min_steps: int = DEFAULT_MIN_STEPS,
    keep_within_interval: bool = True,
) -> tuple[str, str]:
    """:func:`assess`, then ``within_interval`` when a trusted interval already holds the current batch."""
    status, reason = assess(
        est.b_simple, est.ci_low, est.ci_high, est.steps, max_ci_ratio=max_ci_ratio, min_steps=min_steps
    )
    if status == R.OK and keep_within_interval and est.ci_low <= current_batch_size <= est.ci_high:
        return R.WITHIN_INTERVAL, (
            f"the current batch {current_batch_size} already lies inside the interval "
            f"[{est.ci_low:.4g}, {est.ci_high:.4g}]: kept (the trade-off is flat near the knee)"
        )
    end = near_end(est, current_batch_size) if status in (R.TOO_WIDE, R.UNBOUNDED) else None
    if end is not None:
        return R.TOWARD_INTERVAL, (
            f"the interval [{est.ci_low:.4g}, {est.ci_high:.4g}] is too wide to aim at its middle, but lies wholly "
            f"{'below' if est.ci_high < current_batch_size else 'above'} the current batch {current_batch_size}: "
            f"moving to its near end, {end:.4g}"
        )
    return status, reason


def near_end(est: EstimateView, current_batch_size: int) -> Optional[float]:
    """The end of the interval nearest the current batch when the interval lies wholly on one side of it
    (``ci_high`` below it, or a positive ``ci_low`` above it); ``None`` otherwise."""
    if math.isfinite(est.ci_high) and est.ci_high < current_batch_size:
        return est.ci_high
    if math.isfinite(est.ci_low) and est.ci_low > current_batch_size:
        return est.ci_low
    return None
