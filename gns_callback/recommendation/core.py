"""``recommend(estimate, ...)``: a global batch size, its split, a learning rate and a warmup from B_simple.

Which batch: ``B ≈ B_simple``, the knee of McCandlish et al.'s trade-off, where ``S/S_min = E/E_min = 2``:
twice the minimum number of steps for twice the minimum number of examples. Smaller batches waste steps
(wall-clock time on parallel hardware), larger ones waste examples (compute). Pass the *run-averaged* estimate
(``callback.run_estimate``, the report's ``"run_estimate"``) for a fixed batch size: the critical batch of a
run is the noise scale averaged along it, and the late, local value can be far above it.

The pipeline, one small function per stage: read the estimate and the current setup → :func:`.trust.verdict`
(can the estimate be acted on?) → :func:`.hardware.read_hardware` (micro-batch cap from the probe) →
:func:`.batch.aim` or :func:`.batch.keep` (the global batch and its split) → :func:`.learning_rate.choose_lr`
and :func:`.learning_rate.plan_warmup` → :func:`.operating_point.operating_point` for both configurations.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Optional

from gns_callback.recommendation import result as R
from gns_callback.recommendation.batch import BatchChoice, Bounds, Grid, aim, batch_bounds, keep
from gns_callback.recommendation.calibration import may_move
from gns_callback.recommendation.current import CurrentSetup, read_current
from gns_callback.recommendation.hardware import Hardware, fit_advice, read_hardware
from gns_callback.recommendation.learning_rate import LRChoice, Warmup, choose_lr, plan_warmup
from gns_callback.recommendation.objective import (
    BALANCED,
    GOALS,
    KEPT,
    OK,
    Config,
    ObjectivePlan,
    Search,
    StepTimes,
    check_objective,
    device_counts,
    objective_plans,
    with_learning_rates,
)
from gns_callback.per_example.tracker import MIN_COVERAGE
from gns_callback.recommendation.operating_point import (
    Economics,
    operating_point,
    time_to_target_ratio,
    with_target,
)
from gns_callback.recommendation.result import Recommendation
from gns_callback.recommendation.rules import OptimizerLike, optimizer_name
from gns_callback.recommendation.trust import (
    DEFAULT_MAX_CI_RATIO,
    DEFAULT_MIN_STEPS,
    EstimateView,
    assess,
    near_end,
    read_estimate,
    verdict,
)

__all__ = ["DEFAULT_MAX_CI_RATIO", "DEFAULT_MIN_STEPS", "assess", "recommend"]

#: From this share of the step gradient (the parameters left out against the measured ones) a too-wide interval's
#: reason names ``micro_batch`` as the fix.
LEFT_OUT_HINT_SHARE = 0.01


def recommend(
    estimate: Any,
    *,
    current_batch_size: int,
    current_lr: Optional[float],
    optimizer: OptimizerLike = None,
    num_devices: int = 1,
    current_micro_batch_size: Optional[int] = None,
    current_accumulate: Optional[int] = None,
    probe: Any = None,
    max_micro_batch: Optional[int] = None,
    throughput: Optional[Mapping[int, float]] = None,
    dataset_size: Optional[int] = None,
    steps_per_epoch: Optional[int] = None,
    min_batch_size: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    multiple_of: int = 8,
    power_of_two: bool = False,
    lr_rule: Optional[str] = None,
    max_ci_ratio: float = DEFAULT_MAX_CI_RATIO,
    min_steps: int = DEFAULT_MIN_STEPS,
    keep_within_interval: bool = True,
    warmup_threshold: float = 1.0,
    warmup_epochs: float = 5.0,
    price_per_device_hour: Optional[float] = None,
    target_epochs: Optional[float] = None,
    sharpness: Optional[float] = None,
    objective: str = BALANCED,
    max_devices: Optional[int] = None,
    coverage: float = 1.0,
    left_out_share: float = 0.0,
) -> Recommendation:
    """Recommend a global batch size ≈ ``B_simple``, its ``micro × accumulate × devices`` split, LR and warmup.

    Args:
        estimate: a :class:`~gns_callback.GNSEstimate` (preferably the run average), its ``to_dict()``, or any
            object with ``b_simple``, ``ci_low``, ``ci_high``, ``steps``; optionally ``lr_noise_scale`` and
            ``lr_noise_scale_low``, the early phase's noise scale and the lower end of its interval, for the SGD LR
            transfer (what :func:`gns_callback.critical_batch.critical_batch_target` gives).
        current_batch_size: the global batch now (``micro × accumulate × devices``).
        current_lr: the LR tuned for the current batch (the base LR, not a decayed one); ``None``: no LR advice.
        optimizer: class, instance or name; picks the LR rule (SGD family → ``"noise_linear"``, Adam family →
            ``"noise_sqrt"``; see :mod:`.rules`). An instance also gives SGD's momentum for the stability limit.
        num_devices: data-parallel devices (``trainer.world_size``); kept as is.
        current_micro_batch_size, current_accumulate: the current split (the micro-batch is derived from them,
            else ``current_batch_size/num_devices``). Without a probe the recommended batch is one micro-batch
            per device, unless the current setup already accumulates (then its micro-batch is the cap).
        probe: a memory/throughput probe result (``max_micro_batch``, ``trials``), duck-typed or a dict.
        max_micro_batch, throughput: the same given directly (``{micro: samples/s per device}``); they override
            the probe's.
        dataset_size / steps_per_epoch: epoch length (examples / optimizer steps at the current batch) for
            warmup steps, time and cost per epoch; the batch is also clipped to ``dataset_size``.
        min_batch_size, max_batch_size: bounds on the global batch.
        multiple_of, power_of_two: the size grid (global batch a multiple of 8 by default; powers of two).
        lr_rule: ``"noise_linear"``, ``"noise_sqrt"``, ``"linear"``, ``"sqrt"`` or ``"none"`` to override the
            optimizer's family. The noise-aware rules move the LR along ``ε(B) = ε_max/(1 + B_noise/B)^p`` with
            ``B_noise`` = the estimate's ``B_simple``; ``"linear"``/``"sqrt"`` are their small-batch limits.
        max_ci_ratio: largest ``ci_high/ci_low`` trusted; min_steps: fewest measured steps trusted.
        keep_within_interval: keep the current batch when it already lies inside ``[ci_low, ci_high]``.
        warmup_threshold, warmup_epochs: no warmup up to this LR factor (default 1: any increase gets one);
            Goyal's epochs at a 32× LR factor.
        price_per_device_hour: for cost per epoch/to target. target_epochs: epochs the *current* configuration
            needs to reach its target loss (for time/cost to target at both configurations).
        sharpness: ``λ_max``, the top Hessian eigenvalue of the loss (:func:`gns_callback.curvature.sharpness`),
            best the largest seen early in training; caps an SGD-family LR increase at the stability limit
            ``2(1+β)/λ_max`` (:mod:`.stability`). Without it the SGD family's default rule does not raise the LR
            (see :mod:`.learning_rate`); an explicit ``lr_rule`` does.
        objective: what the recommended batch is for (:mod:`.objective`): ``"balanced"`` the knee ``B ≈ B_noise``;
            ``"time"`` the least predicted wall time to the same loss; ``"cost"`` the fewest device-hours. The last
            two need the probe's step times (``probe=`` or ``throughput=``; a ``ValueError`` without either; a
            probe that measured none gives the balanced batch, with a note). All three are in ``plans``.
        max_devices: let "time"/"cost" choose the device count, up to this (``None``: keep ``num_devices``);
            throughput is assumed to scale linearly with devices.
        coverage: the share of the trainable parameters the estimate measured (the meter's ``coverage``). Below
            ``MIN_COVERAGE`` (90%) it is another quantity than the model's noise scale (an LSTM with per-example
            norms of its Linear head alone: 6%), so the batch is kept (status ``partial_coverage``).
        left_out_share: the parameters left out's share of the step gradient (the meter's ``coverage``
            ``left_out_gradient_share``, :mod:`gns_callback.left_out`): where the interval is too wide or unbounded
            and it is 1% or more, the reason says that part of the width is theirs, which more steps don't remove.
    """
    _check_arguments(current_batch_size, num_devices, multiple_of)
    check_objective(objective, max_devices)
    _check_timing_given(objective, probe, throughput)
    est = read_estimate(estimate)
    current = read_current(current_batch_size, num_devices, current_micro_batch_size, current_accumulate)
    status, reason = verdict(est, current_batch_size, max_ci_ratio=max_ci_ratio, min_steps=min_steps,
                             keep_within_interval=keep_within_interval)
    status, reason = _calibrated(status, reason, est, current_batch_size, optimizer)
    status, reason = _covered(status, reason, coverage)
    reason = _left_out_hint(status, reason, left_out_share)
    hardware = read_hardware(probe, max_micro_batch, throughput, current)
    bounds = batch_bounds(min_batch_size, max_batch_size, dataset_size)
    grid = Grid(multiple_of, power_of_two)
    choice = _choose_batch(status, est, bounds, grid, current, hardware.micro_cap)
    search = Search(bounds, grid, hardware.micro_cap, device_counts(num_devices, max_devices))
    plans = _plans(status, reason, est, choice, current, search, hardware, probe is not None or throughput is not None)
    choice, devices, status, reason, chosen_notes = _apply_objective(objective, plans[objective], choice,
                                                                     num_devices, status, reason, est)

    def lr_at(batch_size: int) -> LRChoice:
        return choose_lr(current_lr, current_batch_size, batch_size, optimizer, lr_rule, b_noise=est.b_simple,
                         sharpness=sharpness, early_b_noise=est.lr_noise_scale,
                         early_b_noise_low=est.lr_noise_scale_low)

    lr = lr_at(choice.batch_size)
    plans = with_learning_rates(plans, lambda b: lr_at(b).learning_rate)
    econ = Economics(hardware.throughput, _examples_per_epoch(dataset_size, steps_per_epoch, current_batch_size),
                     price_per_device_hour)
    warmup = plan_warmup(current_lr, lr.learning_rate, choice.batch_size, econ.examples_per_epoch,
                         threshold=warmup_threshold, warmup_epochs=warmup_epochs)
    scaling_note = ("throughput assumed to scale linearly with devices (communication not measured)",)
    notes = hardware.notes + choice.notes
    notes += fit_advice(hardware, current, choice.batch_size, choice.micro_batch_size) + lr.notes + warmup.notes
    notes += scaling_note if (hardware.throughput and max(num_devices, devices) > 1) else ()
    notes += chosen_notes
    rec = _assemble(status, reason, est, current, current_lr, choice, lr, warmup, econ, optimizer, target_epochs,
                    notes, devices)
    return replace(rec, objective=objective, plans=plans, time_to_target_ratio=_plan_time(rec, plans))


def _plan_time(rec: Recommendation, plans: Mapping[str, ObjectivePlan]) -> Optional[float]:
    """The recommended configuration's predicted time ratio from its plan (step times interpolated linearly in
    the micro-batch, :class:`~gns_callback.recommendation.objective.StepTimes`), else the throughput estimate."""
    mine = Config(rec.batch_size, rec.micro_batch_size, rec.accumulate_grad_batches, rec.num_devices)
    for plan in plans.values():
        if plan.config == mine and plan.time is not None and math.isfinite(plan.time.value):
            return plan.time.value
    return rec.time_to_target_ratio


def _plans(status: str, reason: str, est: EstimateView, balanced: BatchChoice, current: CurrentSetup,
           search: Search, hardware: Hardware, probe_given: bool) -> dict[str, ObjectivePlan]:
    """The three objectives' plans (:func:`~gns_callback.recommendation.objective.objective_plans`)."""
    times = StepTimes(hardware.throughput) if hardware.throughput else None
    knee = Config(balanced.batch_size, balanced.micro_batch_size, balanced.accumulate, current.num_devices)
    return objective_plans(status in R.TRUSTED, reason, est.b_simple, est.ci_low, est.ci_high, knee,
                           _current_config(current), search, times, probe_given)


def _check_timing_given(objective: str, probe: Any, throughput: Optional[Mapping[int, float]]) -> None:
    if objective != BALANCED and probe is None and throughput is None:
        raise ValueError(
            f"recommend(objective={objective!r}) needs measured step times: pass probe= (the callback's "
            "probe=True result, or gns_callback.probe.probe_micro_batch) or throughput={micro: samples/s per "
            "device}, or use objective='balanced'"
        )


def _current_config(current: CurrentSetup) -> Config:
    micro = current.micro_batch_size or max(1, current.batch_size // current.num_devices)
    return Config(current.batch_size, micro, current.accumulate or 1, current.num_devices)


def _apply_objective(
    objective: str, chosen: ObjectivePlan, balanced: BatchChoice, num_devices: int, status: str, reason: str,
    est: EstimateView,
) -> tuple[BatchChoice, int, str, str, tuple[str, ...]]:
    """``(choice, devices, status, reason, notes)``: the objective's plan when it was computed (status ``ok``);
    else the balanced batch on the current devices (it keeps the current batch when the estimate is not
    trusted), with a note when the objective's step times were not measured."""
    if objective == BALANCED or chosen.status == KEPT:
        return balanced, num_devices, status, reason, ()
    if chosen.status != OK:
        return balanced, num_devices, status, reason, (f"{chosen.reason}; the balanced batch is recommended",)
    choice = BatchChoice(float(chosen.batch_size), chosen.batch_size, chosen.micro_batch_size,
                         chosen.accumulate_grad_batches, ())
    why = (f"objective={objective!r}: {GOALS[objective]}, predicted from the probe's step times at B_simple = "
           f"{est.b_simple:.4g} (interval {est.ci_low:.4g} – {est.ci_high:.4g})")
    return choice, chosen.num_devices, R.OK, why, ()


def _check_arguments(current_batch_size: int, num_devices: int, multiple_of: int) -> None:
    if current_batch_size is None or current_batch_size <= 0:
        raise ValueError(f"current_batch_size must be a positive int (micro × accumulate × devices), got "
                         f"{current_batch_size!r}")
    if num_devices <= 0 or multiple_of <= 0:
        raise ValueError(f"num_devices and multiple_of must be positive, got num_devices={num_devices!r}, "
                         f"multiple_of={multiple_of!r}")


def _choose_batch(
    status: str, est: EstimateView, bounds: Bounds, grid: Grid, current: CurrentSetup, micro_cap: Optional[int]
) -> BatchChoice:
    """Aim at ``B_simple`` when the verdict is ``ok``, at the interval's near end when ``toward_interval``;
    otherwise keep the current batch."""
    if status == R.OK:
        return aim(est.b_simple, bounds, grid, current, micro_cap)
    if status == R.TOWARD_INTERVAL:
        return aim(near_end(est, current.batch_size), bounds, grid, current, micro_cap,
                   what="the interval's end nearest the current batch")
    return keep(bounds, current, micro_cap)


def _calibrated(status: str, reason: str, est: EstimateView, current_batch_size: int,
                optimizer: OptimizerLike) -> tuple[str, str]:
    """``not_calibrated`` (keep) instead of a decrease the critical batch can't support for this optimizer
    (:mod:`.calibration`)."""
    if status not in (R.OK, R.TOWARD_INTERVAL):
        return status, reason
    target = est.b_simple if status == R.OK else near_end(est, current_batch_size)
    why = may_move(target, current_batch_size, optimizer)
    return (status, reason) if why is None else (R.NOT_CALIBRATED, why)


def _covered(status: str, reason: str, coverage: float) -> tuple[str, str]:
    """``partial_coverage`` (keep) when the estimate measured less than ``MIN_COVERAGE`` of the parameters."""
    if status == R.NO_ESTIMATE or coverage >= MIN_COVERAGE:
        return status, reason
    return R.PARTIAL_COVERAGE, (
        f"the noise scale was measured on {coverage:.1%} of the trainable parameters (the rest are in layers "
        "per-example norms don't support): keeping the current batch size; measure the whole model with "
        "method='micro_batch' (accumulate_grad_batches ≥ 2, or several devices)"
    )


def _left_out_hint(status: str, reason: str, share: float) -> str:
    """The reason, with the fix where the parameters left out widen an interval too wide to act on."""
    if status not in (R.TOO_WIDE, R.UNBOUNDED) or not share >= LEFT_OUT_HINT_SHARE:
        return reason
    return (f"{reason}. Part of the width is the parameters per-example norms leave out (their gradient is "
            f"{share:.1%} of the measured parameters'), which more steps don't remove: method='micro_batch' "
            "(accumulate_grad_batches ≥ 2, or several devices) measures them")


def _finite_or_none(value: Optional[float]) -> Optional[float]:
    return value if value is not None and math.isfinite(value) else None


def _examples_per_epoch(
    dataset_size: Optional[int], steps_per_epoch: Optional[int], current_batch_size: int
) -> Optional[float]:
    if dataset_size is not None:
        return float(dataset_size)
    if steps_per_epoch is not None:
        return float(steps_per_epoch * current_batch_size)
    return None


def _assemble(
    status: str,
    reason: str,
    est: EstimateView,
    current: CurrentSetup,
    current_lr: Optional[float],
    choice: BatchChoice,
    lr: LRChoice,
    warmup: Warmup,
    econ: Economics,
    optimizer: OptimizerLike,
    target_epochs: Optional[float],
    notes: tuple[str, ...],
    devices: int,
) -> Recommendation:
    """The operating points of both configurations, and the :class:`Recommendation` holding everything."""
    cur = operating_point(current.batch_size, current.micro_batch_size, current.accumulate, current.num_devices,
                          current_lr, est, econ)
    rec = operating_point(choice.batch_size, choice.micro_batch_size, choice.accumulate, devices,
                          lr.learning_rate, est, econ)
    ratio = time_to_target_ratio(cur, rec)
    cur, rec = with_target(cur, rec, target_epochs)
    return Recommendation(
        status=status,
        reason=reason,
        batch_size=choice.batch_size,
        micro_batch_size=choice.micro_batch_size,
        accumulate_grad_batches=choice.accumulate,
        num_devices=devices,
        learning_rate=lr.learning_rate,
        lr_rule=lr.rule,
        lr_rule_source=lr.source,
        citation=lr.citation,
        optimizer=optimizer_name(optimizer) if optimizer is not None else "optimizer",
        warmup_steps=warmup.steps,
        warmup_epochs=warmup.epochs,
        warmup_start_factor=warmup.start_factor,
        b_noise=est.b_simple,
        ci_low=est.ci_low,
        ci_high=est.ci_high,
        confidence=est.confidence,
        estimate_steps=est.steps or 0,
        estimate_averaging=est.averaging,
        target_batch_size=choice.target,
        current=cur,
        recommended=rec,
        time_to_target_ratio=ratio,
        notes=notes,
        sharpness=lr.ceiling.sharpness,
        lr_stability_limit=_finite_or_none(lr.ceiling.stability_limit),
        lr_ceiling=_finite_or_none(lr.ceiling.lr),
    )
