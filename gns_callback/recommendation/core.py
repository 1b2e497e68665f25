"""``recommend(estimate, ...)``: a global batch size, its split, a learning rate and a warmup from B_simple.

Which batch: ``B ≈ B_simple``, the knee of McCandlish et al.'s trade-off, where ``S/S_min = E/E_min = 2``:
twice the minimum number of steps for twice the minimum number of examples. Smaller batches waste steps
(wall-clock time on parallel hardware), larger ones waste examples (compute). Pass the *run-averaged* estimate
(``callback.run_estimate``, the report's ``"run_estimate"``) for a fixed batch size: the critical batch of a
run is the noise scale averaged along it, and the late, local value can be far above it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

from gns_callback.recommendation import result as R
from gns_callback.recommendation.result import OperatingPoint, Recommendation
from gns_callback.recommendation.rules import (
    CITATIONS,
    LR_RULES,
    OptimizerLike,
    lr_rule_for,
    optimizer_name,
    scale_lr,
    warmup_epochs_for,
)
from gns_callback.recommendation.sizing import (
    candidates,
    preferred_micro,
    probe_inputs,
    split,
    split_keeping,
)
from gns_callback.recommendation.tradeoff import examples_factor, steps_factor, throughput_at

DEFAULT_MAX_CI_RATIO = 4.0
DEFAULT_MIN_STEPS = 20
#: How far (relative) from the nearest grid size a batch may move to keep the fewest accumulation steps.
_STRICT_WINDOW = 0.10


def _estimate_values(estimate: Any) -> dict[str, Any]:
    """b_simple, ci_low, ci_high, steps, confidence, averaging from a GNSEstimate, its dict, or a duck.

    ``None`` (JSON ``null``) reads as in :meth:`GNSEstimate.from_dict`: unbounded (``inf``) for ``b_simple`` and
    ``ci_high`` once steps were measured, unknown (``nan``) otherwise.
    """
    if estimate is None:
        return dict(b_simple=math.nan, ci_low=math.nan, ci_high=math.nan, steps=0, confidence=0.95, averaging="none")

    def get(name: str) -> Any:
        return estimate.get(name) if isinstance(estimate, Mapping) else getattr(estimate, name, None)

    steps = get("steps")
    steps = None if steps is None else int(steps)
    unbounded = math.inf if steps != 0 else math.nan
    b, lo, hi = get("b_simple"), get("ci_low"), get("ci_high")
    b = unbounded if b is None else float(b)
    return dict(
        b_simple=b,
        ci_low=math.nan if lo is None else float(lo),
        ci_high=(unbounded if not math.isnan(b) else math.nan) if hi is None else float(hi),
        steps=steps,
        confidence=float(get("confidence") or 0.95),
        averaging=str(get("averaging") or "unknown"),
    )


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
        hint = ""
        if math.isfinite(ci_low) and ci_low > 0:
            hint = f" (B_noise is at least {ci_low:.4g}, the interval's lower bound)"
        return R.UNBOUNDED, (
            "the interval is unbounded above (|G|² not resolved from the noise): keeping the current batch "
            f"size; measure over more steps{hint}"
        )
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
    warmup_threshold: float = 2.0,
    warmup_epochs: float = 5.0,
    price_per_device_hour: Optional[float] = None,
    target_epochs: Optional[float] = None,
) -> Recommendation:
    """Recommend a global batch size ≈ ``B_simple``, its ``micro × accumulate × devices`` split, LR and warmup.

    Args:
        estimate: a :class:`~gns_callback.GNSEstimate` (preferably the run average), its ``to_dict()``, or any
            object with ``b_simple``, ``ci_low``, ``ci_high``, ``steps``.
        current_batch_size: the global batch now (``micro × accumulate × devices``).
        current_lr: the LR tuned for the current batch (the base LR, not a decayed one); ``None``: no LR advice.
        optimizer: class, instance or name; picks the LR rule (SGD family → linear, Adam family → sqrt).
        num_devices: data-parallel devices (``trainer.world_size``); kept as is.
        current_micro_batch_size, current_accumulate: the current split (the micro-batch is derived from them,
            else ``current_batch_size/num_devices``); the fallback micro-batch cap without a probe.
        probe: a memory/throughput probe result (``max_micro_batch``, ``trials``), duck-typed or a dict.
        max_micro_batch, throughput: the same given directly (``{micro: samples/s per device}``); they override
            the probe's.
        dataset_size / steps_per_epoch: epoch length (examples / optimizer steps at the current batch) for
            warmup steps, time and cost per epoch; the batch is also clipped to ``dataset_size``.
        min_batch_size, max_batch_size: bounds on the global batch.
        multiple_of, power_of_two: the size grid (global batch a multiple of 8 by default; powers of two).
        lr_rule: ``"linear"``, ``"sqrt"`` or ``"none"`` to override the optimizer's family.
        max_ci_ratio: largest ``ci_high/ci_low`` trusted; min_steps: fewest measured steps trusted.
        keep_within_interval: keep the current batch when it already lies inside ``[ci_low, ci_high]``.
        warmup_threshold, warmup_epochs: no warmup up to this LR factor; Goyal's epochs at a 32× LR factor.
        price_per_device_hour: for cost per epoch/to target. target_epochs: epochs the *current* configuration
            needs to reach its target loss (for time/cost to target at both configurations).
    """
    if current_batch_size is None or current_batch_size <= 0:
        raise ValueError("current_batch_size must be a positive int")
    if num_devices <= 0 or multiple_of <= 0:
        raise ValueError("num_devices and multiple_of must be positive")
    notes: list[str] = []
    est = _estimate_values(estimate)
    b, lo_ci, hi_ci = est["b_simple"], est["ci_low"], est["ci_high"]
    status, reason = assess(b, lo_ci, hi_ci, est["steps"], max_ci_ratio=max_ci_ratio, min_steps=min_steps)

    # --- the current configuration and the micro-batch cap -------------------------------------------------
    cur_micro = current_micro_batch_size
    if cur_micro is None and current_accumulate:
        share, rem = divmod(current_batch_size, current_accumulate * num_devices)
        cur_micro = share if not rem and share else None
    if cur_micro is None and current_batch_size % num_devices == 0:
        cur_micro = current_batch_size // num_devices
    cur_accum = current_accumulate
    if cur_accum is None and cur_micro:
        cur_accum = max(1, round(current_batch_size / (cur_micro * num_devices)))

    probe_max, probe_table = probe_inputs(probe)
    max_micro = max_micro_batch if max_micro_batch is not None else probe_max
    if max_micro is not None and max_micro < 1:
        notes.append("the probe found no micro-batch that fits the memory budget: its limit is ignored")
        max_micro = None
    table = {int(k): float(v) for k, v in (throughput if throughput is not None else probe_table).items()}
    micro_cap, cap_source = preferred_micro(max_micro, table, cur_micro)
    if micro_cap is not None and max_micro is not None and micro_cap > max_micro:
        micro_cap = max_micro
    if probe is None and max_micro_batch is None and throughput is None:
        notes.append(f"micro-batch: {cap_source}")
    else:
        notes.append(f"micro-batch cap: {cap_source}")

    # --- the batch size ------------------------------------------------------------------------------------
    lo = max(1, min_batch_size or 1)
    hi: float = math.inf
    if max_batch_size is not None:
        hi = max_batch_size
    if dataset_size is not None and dataset_size < hi:
        hi = dataset_size
    if lo > hi:
        notes.append(f"min_batch_size {lo} above the upper bound {hi:g}: using the upper bound")
        lo = int(hi)

    if status == R.OK and keep_within_interval and lo_ci <= current_batch_size <= hi_ci:
        status, reason = R.WITHIN_INTERVAL, (
            f"the current batch {current_batch_size} already lies inside the interval "
            f"[{lo_ci:.4g}, {hi_ci:.4g}]: kept (the trade-off is flat near the knee)"
        )

    if status == R.OK:
        target = b
        if target < lo:
            notes.append(f"B_simple = {b:.4g} is below the lower bound {lo}: raised to it")
        elif target > hi:
            why = "the data-set size" if dataset_size is not None and hi == dataset_size else "max_batch_size"
            notes.append(f"B_simple = {b:.4g} is above {why} ({hi:g}): clipped")
        batch, (micro, accum) = _choose(target, lo, hi, num_devices, micro_cap, multiple_of, power_of_two, notes)
    else:
        target = float(current_batch_size)
        batch = current_batch_size
        parts = split_keeping(batch, num_devices, micro_cap)
        if parts is None:  # the current batch does not divide over the devices: smallest change that does
            batch, parts = _choose(target, 1, math.inf, num_devices, micro_cap, 1, False, notes)
        micro, accum = parts
        if cur_micro is not None and micro != cur_micro:
            notes.append(
                f"batch size kept; micro-batch {cur_micro} → {micro} (accumulate {cur_accum} → {accum})"
            )

    # --- learning rate -------------------------------------------------------------------------------------
    if lr_rule is not None:
        if lr_rule not in LR_RULES:
            raise ValueError(f"lr_rule must be one of {LR_RULES}, got {lr_rule!r}")
        rule, source = lr_rule, "user override"
    else:
        rule, unknown = lr_rule_for(optimizer)
        if unknown:
            notes.append(unknown)
            source = "unknown optimizer: default" if rule != "none" else f"{optimizer_name(optimizer)}"
        else:
            family = {"linear": "SGD family", "sqrt": "adaptive (Adam) family", "none": "no rule"}[rule]
            source = f"{family}: {optimizer_name(optimizer)}"
    if rule == "sqrt" and source.startswith("adaptive"):
        notes.append(
            "Malladi et al.'s square-root rule also scales 1−β₁, 1−β₂ by κ = B_new/B_old and ε by 1/√κ; only "
            "the LR is changed here"
        )
    new_lr = None if current_lr is None else scale_lr(current_lr, current_batch_size, batch, rule)

    # --- warmup --------------------------------------------------------------------------------------------
    examples_per_epoch: Optional[float] = None
    if dataset_size is not None:
        examples_per_epoch = float(dataset_size)
    elif steps_per_epoch is not None:
        examples_per_epoch = float(steps_per_epoch * current_batch_size)
    lr_factor = new_lr / current_lr if (new_lr is not None and current_lr) else 1.0
    w_epochs = warmup_epochs_for(lr_factor, threshold=warmup_threshold, warmup_epochs=warmup_epochs)
    w_steps: Optional[int] = 0
    w_start = None
    if w_epochs > 0:
        w_start = current_lr / new_lr
        w_steps = None if examples_per_epoch is None else max(1, math.ceil(w_epochs * examples_per_epoch / batch))
        if w_steps is None:
            notes.append(f"warmup of {w_epochs:.3g} epochs advised: pass dataset_size or steps_per_epoch for steps")

    # --- operating points ----------------------------------------------------------------------------------
    def point(bs: int, mb: Optional[int], acc: Optional[int], lr: Optional[float]) -> OperatingPoint:
        sps = throughput_at(table, mb) if (table and mb) else None
        sps = None if sps is None else sps * num_devices
        spe = None if examples_per_epoch is None else math.ceil(examples_per_epoch / bs)
        epoch_s = None if (sps is None or examples_per_epoch is None) else examples_per_epoch / sps
        cost = None
        if epoch_s is not None and price_per_device_hour is not None:
            cost = price_per_device_hour * num_devices * epoch_s / 3600.0
        return OperatingPoint(
            batch_size=bs,
            micro_batch_size=mb,
            accumulate_grad_batches=acc,
            num_devices=num_devices,
            learning_rate=lr,
            steps_factor=steps_factor(bs, b),
            examples_factor=examples_factor(bs, b),
            steps_factor_at_ci_low=steps_factor(bs, lo_ci),
            steps_factor_at_ci_high=steps_factor(bs, hi_ci),
            examples_factor_at_ci_low=examples_factor(bs, lo_ci),
            examples_factor_at_ci_high=examples_factor(bs, hi_ci),
            samples_per_sec=sps,
            steps_per_epoch=spe,
            epoch_seconds=epoch_s,
            cost_per_epoch=cost,
        )

    cur = point(current_batch_size, cur_micro, cur_accum, current_lr)
    rec = point(batch, micro, accum, new_lr)
    ratio = None
    if cur.samples_per_sec and rec.samples_per_sec and math.isfinite(cur.examples_factor):
        ratio = (rec.examples_factor / rec.samples_per_sec) / (cur.examples_factor / cur.samples_per_sec)
    if target_epochs is not None and math.isfinite(cur.examples_factor) and math.isfinite(rec.examples_factor):
        cur, rec = (_with_target(p, target_epochs * p.examples_factor / cur.examples_factor) for p in (cur, rec))
    if table and num_devices > 1:
        notes.append("throughput assumed to scale linearly with devices (communication not measured)")

    return Recommendation(
        status=status,
        reason=reason,
        batch_size=batch,
        micro_batch_size=micro,
        accumulate_grad_batches=accum,
        num_devices=num_devices,
        learning_rate=new_lr,
        lr_rule=rule,
        lr_rule_source=source,
        citation=CITATIONS[rule] if source != "user override" else f"user override ({CITATIONS[rule]})",
        optimizer=optimizer_name(optimizer) if optimizer is not None else "optimizer",
        warmup_steps=w_steps,
        warmup_epochs=w_epochs,
        warmup_start_factor=w_start,
        b_noise=b,
        ci_low=lo_ci,
        ci_high=hi_ci,
        confidence=est["confidence"],
        estimate_steps=est["steps"] or 0,
        estimate_averaging=est["averaging"],
        target_batch_size=target,
        current=cur,
        recommended=rec,
        time_to_target_ratio=ratio,
        notes=tuple(notes),
    )


def _with_target(p: OperatingPoint, epochs: float) -> OperatingPoint:
    from dataclasses import replace

    time_s = None if p.epoch_seconds is None else epochs * p.epoch_seconds
    cost = None if p.cost_per_epoch is None else epochs * p.cost_per_epoch
    return replace(p, epochs_to_target=epochs, time_to_target_s=time_s, cost_to_target=cost)


def _choose(
    target: float,
    lo: int,
    hi: float,
    num_devices: int,
    micro_cap: Optional[int],
    multiple_of: int,
    power_of_two: bool,
    notes: list[str],
) -> tuple[int, tuple[int, int]]:
    """The grid size nearest ``target`` that splits over the devices (see :mod:`.sizing`), with notes."""
    grids = []
    if power_of_two:
        grids.append((multiple_of, True, "a power of two"))
    grids.append((multiple_of, False, f"a multiple of {multiple_of}"))
    if multiple_of != 1:
        grids.append((1, False, "any size"))
    nearest = None
    for i, (step, pow2, label) in enumerate(grids):
        first = next(candidates(target, lo, hi, step, pow2), None)
        if first is None:
            continue
        nearest = first if nearest is None else nearest
        window = abs(first - target) + _STRICT_WINDOW * first
        found = None
        for size in candidates(target, lo, hi, step, pow2):  # 1. strict, near the target
            if abs(size - target) > window:
                break
            parts = split(size, num_devices, micro_cap)
            if parts is not None:
                found = size, parts
                break
        if found is None:  # 2. relaxed: more, smaller micro-batches (but above half the cap)
            for size in candidates(target, lo, hi, step, pow2):
                parts = split(size, num_devices, micro_cap, strict=False)
                if parts is not None:
                    found = size, parts
                    break
        if found is None:
            continue
        size, (micro, accum) = found
        if i > 0:
            notes.append(f"no size in range that is {grids[0][2]} splits over the devices: using {label}")
        if size != nearest:
            notes.append(
                f"global batch adjusted from {nearest} to {size} so that micro × accumulate × devices = "
                f"{micro} × {accum} × {num_devices} divides exactly"
            )
        return found
    # Nothing in [lo, hi] splits (hi below the device count): one example per device.
    notes.append(f"no batch size in [{lo}, {hi:g}] splits over {num_devices} devices: using one per device")
    return num_devices, (1, 1)
