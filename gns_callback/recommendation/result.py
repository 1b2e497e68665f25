"""The result of :func:`~gns_callback.recommendation.recommend`: plain dataclasses, JSON-safe, printable."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from gns_callback.json_values import json_safe
from gns_callback.recommendation.objective import BALANCED, OBJECTIVES, ObjectivePlan, Ratio
from gns_callback.recommendation.rules import warmup_lr

#: ``status`` values. The first two are trusted estimates; the others keep the current batch size.
OK = "ok"  # B ≈ B_simple recommended
WITHIN_INTERVAL = "within_interval"  # the current batch already lies inside the interval: kept
NO_ESTIMATE = "no_estimate"  # nothing measured (B_simple is nan)
TOO_FEW_STEPS = "too_few_steps"
UNBOUNDED = "unbounded"  # |G|² not resolved: ci_high (or B_simple) infinite
TOO_WIDE = "too_wide"  # ci_high/ci_low above max_ci_ratio
TOWARD_INTERVAL = "toward_interval"  # too wide or unbounded, but the whole interval lies on one side: moved to its near end
NOT_CALIBRATED = "not_calibrated"  # a decrease on an optimizer the critical batch is not calibrated for: kept
PARTIAL_COVERAGE = "partial_coverage"  # the estimate is that of too small a share of the parameters: kept
TRUSTED = (OK, WITHIN_INTERVAL)
#: What ``adapt=True`` acts on: a trusted estimate, or an interval wholly on one side of the current batch, whose near
#: end it moves to (the smallest move every value of the interval agrees with).
ACTIONABLE = (*TRUSTED, TOWARD_INTERVAL)
STATUSES = (OK, WITHIN_INTERVAL, NO_ESTIMATE, TOO_FEW_STEPS, UNBOUNDED, TOO_WIDE, TOWARD_INTERVAL,
            NOT_CALIBRATED, PARTIAL_COVERAGE)

# Float fields whose ``null`` in JSON means "unbounded" (``inf``), unless nothing was measured (``nan``).
_UNBOUNDED_FIELDS = {
    "b_noise",
    "ci_high",
    "target_batch_size",
    "steps_factor",
    "examples_factor",
    "steps_factor_at_ci_low",
    "steps_factor_at_ci_high",
    "examples_factor_at_ci_low",
    "examples_factor_at_ci_high",
}


def _from_json_float(name: str, v: Any, missing: float) -> Any:
    if v is None and name in _UNBOUNDED_FIELDS:
        return missing
    if v is None and name == "ci_low":
        return math.nan
    return v


@dataclass(frozen=True)
class OperatingPoint:
    """One configuration (current or recommended) and what the model predicts for it.

    Attributes:
        batch_size: global batch ``micro × accumulate × devices``.
        steps_factor, examples_factor: ``S/S_min = 1 + B_noise/B`` and ``E/E_min = 1 + B/B_noise`` at
            ``B_noise = B_simple``; ``*_at_ci_low``/``*_at_ci_high`` the same at the interval's ends.
        samples_per_sec: global throughput predicted from the probe (per-device samples/s at the micro-batch
            × devices); ``None`` without a throughput table. Then per epoch: ``steps_per_epoch``,
            ``epoch_seconds``, ``cost_per_epoch`` (with ``price_per_device_hour``).
        epochs_to_target, time_to_target_s, cost_to_target: given ``target_epochs`` (what the *current*
            configuration needs), scaled by the examples factor: ``epochs·E(B)/E(B_current)``.
    """

    batch_size: int
    micro_batch_size: Optional[int]
    accumulate_grad_batches: Optional[int]
    num_devices: int
    learning_rate: Optional[float]
    steps_factor: float
    examples_factor: float
    steps_factor_at_ci_low: float
    steps_factor_at_ci_high: float
    examples_factor_at_ci_low: float
    examples_factor_at_ci_high: float
    samples_per_sec: Optional[float] = None
    steps_per_epoch: Optional[int] = None
    epoch_seconds: Optional[float] = None
    cost_per_epoch: Optional[float] = None
    epochs_to_target: Optional[float] = None
    time_to_target_s: Optional[float] = None
    cost_to_target: Optional[float] = None

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any], missing: float = math.inf) -> "OperatingPoint":
        names = {f.name for f in fields(cls)}
        return cls(**{k: _from_json_float(k, v, missing) for k, v in data.items() if k in names})


@dataclass(frozen=True)
class Recommendation:
    """A global batch size, its Lightning split, learning rate and warmup, with the reasoning.

    Attributes:
        status, reason: one of ``STATUSES`` and a sentence; untrusted estimates keep the current batch size.
        batch_size, micro_batch_size, accumulate_grad_batches, num_devices: ``micro × accumulate × devices =
            batch_size`` (``micro_batch_size`` is the per-device ``DataLoader(batch_size=...)``).
        learning_rate: the current LR scaled by ``lr_rule`` (``"linear"``, ``"sqrt"``, ``"none"``);
            ``lr_rule_source`` says why that rule (optimizer family, override, unknown default); ``citation``.
        warmup_steps: optimizer steps of linear warmup from the current LR to the new one (``None`` when a
            warmup is advised but the epoch length is unknown; ``0`` for none); ``warmup_epochs`` the same in
            epochs; ``warmup_start_factor = current_lr/learning_rate`` for ``LinearLR(start_factor=...)``.
        b_noise, ci_low, ci_high, confidence, estimate_steps, estimate_averaging: the estimate used
            (``B_simple`` stands in for ``B_noise``).
        target_batch_size: the size aimed at before rounding/clipping/splitting (``B_simple`` when trusted).
        current, recommended: :class:`OperatingPoint` for both configurations.
        time_to_target_ratio: predicted wall time to the same loss, recommended/current
            (``E/E_min`` over throughput; needs the throughput table).
        notes: adjustments made on the way (rounding, clipping, divisibility, assumptions).
        sharpness, lr_stability_limit: the top Hessian eigenvalue ``λ_max`` passed in and the SGD stability
            limit ``2(1+β)/λ_max`` that bounds an LR increase (``None`` when not given, not an SGD rule, or
            no positive curvature).
        lr_ceiling: the largest LR this recommendation allows at any batch: ``max(current LR, stability
            limit)``, or the current LR for the SGD family's default rule without a sharpness; ``None``: no bound.
        objective: what the recommended batch is for (``"balanced"``, ``"time"``, ``"cost"``); ``plans``: the
            three objectives side by side, ``{objective: ObjectivePlan}`` (:mod:`.objective`).
    """

    status: str
    reason: str
    batch_size: int
    micro_batch_size: int
    accumulate_grad_batches: int
    num_devices: int
    learning_rate: Optional[float]
    lr_rule: str
    lr_rule_source: str
    citation: str
    optimizer: str
    warmup_steps: Optional[int]
    warmup_epochs: float
    warmup_start_factor: Optional[float]
    b_noise: float
    ci_low: float
    ci_high: float
    confidence: float
    estimate_steps: int
    estimate_averaging: str
    target_batch_size: float
    current: OperatingPoint
    recommended: OperatingPoint
    time_to_target_ratio: Optional[float] = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    sharpness: Optional[float] = None
    lr_stability_limit: Optional[float] = None
    lr_ceiling: Optional[float] = None
    objective: str = BALANCED
    plans: dict[str, ObjectivePlan] = field(default_factory=dict)

    @property
    def trusted(self) -> bool:
        """The estimate was good enough to act on (``status`` is ``"ok"`` or ``"within_interval"``)."""
        return self.status in TRUSTED

    @property
    def actionable(self) -> bool:
        """Good enough to change a running fit by (:data:`ACTIONABLE`): trusted, or toward the interval's near end."""
        return self.status in ACTIONABLE

    @property
    def changed(self) -> bool:
        """The global batch size differs from the current one."""
        return self.batch_size != self.current.batch_size

    def lr_at(self, step: int) -> Optional[float]:
        """The learning rate ``step`` optimizer steps after switching (linear warmup, then flat)."""
        if self.learning_rate is None:
            return None
        start = self.current.learning_rate if self.current.learning_rate is not None else self.learning_rate
        return warmup_lr(step, start_lr=start, target_lr=self.learning_rate, warmup_steps=self.warmup_steps)

    # --- serialisation -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (non-finite floats → ``null``), the report's ``"recommendation"`` section."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["current"] = self.current.to_dict()
        data["recommended"] = self.recommended.to_dict()
        data["notes"] = list(self.notes)
        data["plans"] = {name: plan.to_dict() for name, plan in self.plans.items()}
        return json_safe(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recommendation":
        """Inverse of :meth:`to_dict`; ``null`` in factor/bound fields reads back as ``inf`` (``nan`` if nothing
        was measured)."""
        missing = math.nan if data.get("status") == NO_ESTIMATE else math.inf
        names = {f.name for f in fields(cls)}
        values = {k: _from_json_float(k, v, missing) for k, v in data.items() if k in names}
        values["current"] = OperatingPoint.from_dict(data["current"], missing)
        values["recommended"] = OperatingPoint.from_dict(data["recommended"], missing)
        values["notes"] = tuple(data.get("notes") or ())
        values["plans"] = {name: ObjectivePlan.from_dict(p) for name, p in (data.get("plans") or {}).items()}
        return cls(**values)

    # --- text ----------------------------------------------------------------------------------------------
    def lightning_settings(self) -> str:
        """The settings to paste into a Lightning script."""
        lines = [
            f"Trainer(devices={self.num_devices}, accumulate_grad_batches={self.accumulate_grad_batches})",
            f"DataLoader(dataset, batch_size={self.micro_batch_size})   # per-device micro-batch",
        ]
        if self.learning_rate is not None:
            lines.append(f"{self.optimizer}(params, lr={self.learning_rate:.6g})   # {self.lr_rule} rule")
        if self.warmup_steps:
            lines.append(
                f"LinearLR(optimizer, start_factor={self.warmup_start_factor:.4g}, total_iters={self.warmup_steps})"
                '   # "interval": "step"; chain with SequentialLR if you already have a schedule'
            )
        elif self.warmup_steps is None and self.warmup_epochs > 0:
            lines.append(
                f"LinearLR(optimizer, start_factor={self.warmup_start_factor:.4g}, total_iters=<steps in "
                f"{self.warmup_epochs:.3g} epochs>)"
            )
        return "\n".join(lines)

    def summary_table(self) -> str:
        """Current vs recommended, the interval, the LR rule, and the Lightning settings to paste."""
        level = round(100 * self.confidence) if math.isfinite(self.confidence) else 95
        cur, rec = self.current, self.recommended
        head = (
            f"Gradient noise scale: B_simple = {_num(self.b_noise, 4)} ({level}% CI {_num(self.ci_low, 4)} – "
            f"{_num(self.ci_high, 4)}; {self.estimate_averaging}, {self.estimate_steps} steps)"
        ) if not math.isnan(self.b_noise) else (  # before: "B_simple = – (95% CI – – –; ..."
            f"Gradient noise scale: B_simple not measured ({self.estimate_averaging}, {self.estimate_steps} steps)")
        rows: list[tuple[str, str, str]] = [
            ("global batch size", str(cur.batch_size), str(rec.batch_size)),
            ("micro × accumulate × devices", _split(cur), _split(rec)),
            ("learning rate", _num(cur.learning_rate, 4), _num(rec.learning_rate, 4)),
            ("S/S_min (steps)", _factor(cur, "steps"), _factor(rec, "steps")),
            ("E/E_min (examples)", _factor(cur, "examples"), _factor(rec, "examples")),
        ]
        optional = [
            ("samples/s", "samples_per_sec", _num),
            ("steps per epoch", "steps_per_epoch", _num),
            ("time per epoch", "epoch_seconds", _duration),
            ("cost per epoch", "cost_per_epoch", _money),
            ("epochs to target", "epochs_to_target", _num),
            ("time to target", "time_to_target_s", _duration),
            ("cost to target", "cost_to_target", _money),
        ]
        for label, name, fmt in optional:
            a, b = getattr(cur, name), getattr(rec, name)
            if a is not None or b is not None:
                rows.append((label, fmt(a), fmt(b)))
        w0 = max(len(r[0]) for r in rows) + 2
        w1 = max(max(len(r[1]) for r in rows), len("current")) + 3
        lines = [head, f"Status: {self.status} — {self.reason}", ""]
        lines.append(f"{'':<{w0}}{'current':<{w1}}recommended")
        lines += [f"{a:<{w0}}{b:<{w1}}{c}" for a, b, c in rows]
        lines.append("")
        lines.append(f"LR rule: {self.lr_rule} ({self.lr_rule_source}) — {self.citation}")
        if self.lr_stability_limit is not None:
            lines.append(
                f"Stability limit: lr ≤ {_num(self.lr_stability_limit, 4)} (SGD, λ_max = {_num(self.sharpness, 4)})"
            )
        if self.warmup_steps:
            lines.append(
                f"Warmup: {self.warmup_steps} steps ({self.warmup_epochs:.3g} epochs), linear from "
                f"{_num(cur.learning_rate, 4)} to {_num(self.learning_rate, 4)}"
            )
        elif self.warmup_epochs > 0:
            lines.append(f"Warmup: {self.warmup_epochs:.3g} epochs (pass dataset_size for steps)")
        else:
            lines.append("Warmup: none needed")
        if self.time_to_target_ratio is not None:
            lines.append(
                f"Predicted time to the same loss: {self.time_to_target_ratio:.3g}× the current "
                "(E/E_min over the probe's throughput)"
            )
        if self.plans:
            lines += ["", *objectives_table(self.plans, self.objective), ""]
        if self.notes:
            lines.append("Notes:")
            lines += [f"  - {n}" for n in self.notes]
        lines.append("Lightning settings:")
        lines += ["  " + s for s in self.lightning_settings().splitlines()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary_table()


_PLAN_ROWS = (("steps vs current", "steps"), ("examples vs current", "examples"), ("time vs current", "time"),
              ("device-hours vs current", "device_hours"))


def objectives_table(plans: dict[str, ObjectivePlan], chosen: str) -> list[str]:
    """The three objectives side by side: batch, split, LR, and steps/examples/time/device-hours relative to the
    current setting with their range over the B_simple interval; the chosen column marked ``*``."""
    names = [n for n in OBJECTIVES if n in plans]
    head = ["objective"] + [f"{n}{' *' if n == chosen else ''}" for n in names]
    rows = [head,
            ["global batch"] + [_num(plans[n].batch_size) for n in names],
            ["micro × accumulate × devices"] + [_plan_split(plans[n]) for n in names],
            ["learning rate"] + [_num(plans[n].learning_rate, 4) for n in names]]
    rows += [[label] + [_ratio(getattr(plans[n], attr)) for n in names] for label, attr in _PLAN_ROWS]
    widths = [max(len(r[i]) for r in rows) + 2 for i in range(len(head))]
    lines = ["Objectives (ratios to the current setting, [range over the B_simple interval]; * = recommended):"]
    lines += ["  " + "".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"  {n}: {plans[n].reason}" for n in names if plans[n].status != "ok" and plans[n].reason]
    return lines


def _plan_split(plan: ObjectivePlan) -> str:
    if plan.batch_size is None:
        return "not measured"
    return f"{plan.micro_batch_size} × {plan.accumulate_grad_batches} × {plan.num_devices}"


def _ratio(r: Optional[Ratio]) -> str:
    if r is None:
        return "–"
    if math.isnan(r.low) or math.isnan(r.high):
        return f"{_num(r.value)}×"
    return f"{_num(r.value)}× [{_num(r.low)}–{_num(r.high)}]"


def _num(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float) and math.isinf(v):
        return "∞"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}g}"


def _split(p: OperatingPoint) -> str:
    return f"{_num(p.micro_batch_size)} × {_num(p.accumulate_grad_batches)} × {p.num_devices}"


def _factor(p: OperatingPoint, kind: str) -> str:
    mid = getattr(p, f"{kind}_factor")
    a, b = getattr(p, f"{kind}_factor_at_ci_low"), getattr(p, f"{kind}_factor_at_ci_high")
    if math.isnan(mid):
        return "–"
    lo, hi = (a, b) if not (a > b) else (b, a)
    return f"{_num(mid)} [{_num(lo)}–{_num(hi)}]"


def _duration(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return _num(seconds)
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _money(v: Optional[float]) -> str:
    if v is None or not math.isfinite(v):
        return _num(v)
    return f"{v:.3g}"
