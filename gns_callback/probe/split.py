"""Split-factor / accumulation search for a fixed global batch (pure: trials come in through ``measure``).

For a fixed global batch ``G`` on ``D`` devices (seed: ``PER_GPU_BATCH_SIZE × grad_accumulation_batches ×
num_gpus = global_batch_size``)::

    micro × accumulate × D = G

Fewer accumulation steps with larger micro-batches are faster as long as they fit. A model that splits its
micro-batch for a memory-hungry part (RNN-T's joint network: ``micro / batch_split_factor = joint batch``) can go
further: keeping ``accumulate × split = K`` constant keeps the joint batch ``G / (D·K)`` constant while the
rest of the network sees larger micro-batches. The seed's recipe: (2) the smallest ``accumulate`` that fits
with ``split = 1``; (3) trade accumulation for split at constant product until it runs out of memory; if no
``split > 1`` fits, double ``accumulate`` once and retry (3); keep the fastest setting.

Throughput of a setting from its measured times (forward+backward per micro-batch ``t_fb``, optimizer step
``t_opt``): ``samples/s = D·micro·accumulate / (accumulate·t_fb + t_opt)``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from gns_callback.probe.agreement import NOTHING, Agree, AgreedOutcome, TimedOutcome, agree_or_raise, agree_outcomes


@dataclass(frozen=True)
class SplitSetting:
    """``micro_batch × accumulate × devices = global batch``; ``micro_batch / split`` = the joint batch."""

    micro_batch: int
    accumulate: int
    split: int = 1

    @property
    def joint_batch(self) -> int:
        return self.micro_batch // self.split


@dataclass(frozen=True)
class SplitMeasurement:
    """A setting and what was measured for it (slowest rank's times under DDP): median forward+backward and
    optimizer seconds, and ``rel_noise``, the relative half-width of the 95% interval of the median step time
    (``None``: unknown)."""

    setting: SplitSetting
    ok: bool
    step_seconds: Optional[float] = None
    optimizer_seconds: Optional[float] = None
    rel_noise: Optional[float] = None

    def samples_per_s(self, devices: int = 1) -> Optional[float]:
        """``D·micro·accumulate / (accumulate·t_fb + t_opt)``; ``None`` if not (successfully) timed."""
        if not self.ok or self.step_seconds is None or self.optimizer_seconds is None:
            return None
        s = self.setting
        seconds = s.accumulate * self.step_seconds + self.optimizer_seconds
        return devices * s.micro_batch * s.accumulate / seconds if seconds > 0 else None


@dataclass
class SplitResult:
    """The search's outcome: the fastest fitting ``best`` setting (``None`` if none fits) and all measurements."""

    global_batch: int
    devices: int
    uses_split_factor: bool
    best: Optional[SplitSetting]
    samples_per_s: Optional[float]
    measurements: list[SplitMeasurement] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "global_batch": self.global_batch,
            "devices": self.devices,
            "uses_split_factor": self.uses_split_factor,
            "best": None if self.best is None else asdict(self.best),
            "samples_per_s": self.samples_per_s,
            "measurements": [
                {**asdict(m.setting), "ok": m.ok, "step_seconds": m.step_seconds,
                 "optimizer_seconds": m.optimizer_seconds, "rel_noise": m.rel_noise}
                for m in self.measurements
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SplitResult":
        measurements = [
            SplitMeasurement(SplitSetting(m["micro_batch"], m["accumulate"], m["split"]), m["ok"],
                             m.get("step_seconds"), m.get("optimizer_seconds"), m.get("rel_noise"))
            for m in data.get("measurements", [])
        ]
        best = data.get("best")
        return cls(data["global_batch"], data["devices"], data["uses_split_factor"],
                   None if best is None else SplitSetting(**best), data.get("samples_per_s"), measurements)


# ---------------------------------------------------------------------------------------------- pure search
def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, increasing."""
    if n < 1:
        raise ValueError(f"divisors({n}): need a positive integer.")
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def per_device_batch(global_batch: int, devices: int) -> int:
    """``global_batch / devices``; both positive and divisible, else ``ValueError``."""
    if global_batch < 1 or devices < 1 or global_batch % devices:
        raise ValueError(f"global batch {global_batch} is not a positive multiple of {devices} device(s).")
    return global_batch // devices


def accumulation_settings(global_batch: int, devices: int, max_micro_batch: Optional[int] = None) -> list[SplitSetting]:
    """Every ``(micro, accumulate, 1)`` with ``micro × accumulate × devices = global`` and ``micro ≤ max``,
    largest micro-batch (fewest accumulation steps) first."""
    per_device = per_device_batch(global_batch, devices)
    settings = [SplitSetting(per_device // a, a, 1) for a in divisors(per_device)]
    return [s for s in settings if max_micro_batch is None or s.micro_batch <= max_micro_batch]


def smallest_fitting_accumulation(global_batch: int, devices: int, max_micro_batch: int) -> Optional[int]:
    """Seed step 2: the fewest accumulation steps whose micro-batch fits (``None``: not even micro-batch 1)."""
    settings = accumulation_settings(global_batch, devices, max_micro_batch)
    return settings[0].accumulate if settings else None


def split_settings(global_batch: int, devices: int, product: int) -> list[SplitSetting]:
    """Every ``(micro, accumulate, split)`` with ``accumulate × split = product``, ``micro × accumulate × devices =
    global`` and ``split`` dividing ``micro``, by increasing split (the order the seed explores them)."""
    per_device = per_device_batch(global_batch, devices)
    settings = []
    for split in divisors(product):
        accumulate = product // split
        if per_device % accumulate:
            continue
        micro = per_device // accumulate
        if micro % split == 0:
            settings.append(SplitSetting(micro, accumulate, split))
    return settings


def _interval(m: SplitMeasurement, devices: int) -> tuple[float, float]:
    rate, noise = m.samples_per_s(devices) or 0.0, min(m.rel_noise or 0.0, 0.99)
    return rate / (1 + noise), rate / (1 - noise)


def choose_fastest(measurements: Sequence[SplitMeasurement], devices: int = 1) -> Optional[SplitMeasurement]:
    """The fitting measurement with the highest samples/s, or one that cannot be told apart from it within the
    measured noise (``rel_noise``) with fewer accumulation steps (then more split, then more samples/s)."""
    timed = [m for m in measurements if m.samples_per_s(devices) is not None]
    if not timed:
        return None
    top = max(timed, key=lambda m: (m.samples_per_s(devices), -m.setting.accumulate, m.setting.split))
    floor = _interval(top, devices)[0]
    tied = [m for m in timed if _interval(m, devices)[1] >= floor]
    return max(tied, key=lambda m: (-m.setting.accumulate, m.setting.split, m.samples_per_s(devices)))


# ---------------------------------------------------------------------------------------------- measured
#: ``measure(micro_batch, split)`` runs one timed trial (``split`` is ``None`` when the model has no split factor).
Measure = Callable[[int, Optional[int]], TimedOutcome]


def _measure_agreed(
    settings: Sequence[SplitSetting], measure: Measure, agree: Agree, *, with_split: bool, stop_after_failure: bool
) -> list[SplitMeasurement]:
    """Measure ``settings`` in order (locally stopping at the first failing ``split > 1`` if asked), then agree
    over ranks: a setting fits only if it fitted everywhere, and takes the slowest rank's times. Settings some
    rank did not try are left out."""
    outcomes: list[Optional[TimedOutcome]] = []
    error: Optional[BaseException] = None
    stopped = False
    for setting in settings:
        outcome = None
        if not stopped and error is None:
            try:
                outcome = measure(setting.micro_batch, setting.split if with_split else None)
            except Exception as exc:  # re-raised by the agreement, once every rank has reached it
                error = exc
            else:
                stopped = stop_after_failure and setting.split > 1 and not outcome.ok
        outcomes.append(outcome)
    agreed = agree_outcomes(agree, outcomes, error)
    return [_measurement(setting, a) for setting, a in zip(settings, agreed) if a is not None]


def _measurement(setting: SplitSetting, agreed: AgreedOutcome) -> SplitMeasurement:
    timing = agreed.timing
    if not agreed.ok or timing is None:
        return SplitMeasurement(setting, agreed.ok)
    return SplitMeasurement(setting, True, timing.step_seconds, timing.optimizer_seconds, timing.rel_halfwidth)


def _agreed_base_accumulation(
    global_batch: int, devices: int, max_micro_batch: int, measure: Measure, agree: Agree
) -> Optional[int]:
    """Seed step 2 by trials at ``split = 1`` (when the probe's maximum was measured at another split): the
    fewest accumulation steps that fit on every rank. Sizes above the probe's maximum are not tried: splitting
    only saves memory, so with ``split = 1`` they cannot fit either."""
    local, error = 0, None
    try:
        for setting in accumulation_settings(global_batch, devices, max_micro_batch):
            if measure(setting.micro_batch, 1).ok:
                local = setting.accumulate
                break
    except Exception as exc:  # re-raised by the agreement
        error = exc
    # min over ranks of −accumulate is the largest accumulate any rank needs; "nothing fits" dominates.
    (value,) = agree_or_raise(agree, [-float(local) if local else NOTHING], error)
    return None if value <= NOTHING / 2 else int(-value)


def _trade_accumulation_for_split(
    measure: Measure, agree: Agree, global_batch: int, devices: int, base: Optional[int]
) -> list[SplitMeasurement]:
    """Seed step 3 from ``accumulate × split = base``: by increasing split until one runs out of memory; if no
    ``split > 1`` fits, double the product once and retry."""
    measurements: list[SplitMeasurement] = []
    product, rounds = base, 0
    while product is not None:
        settings = split_settings(global_batch, devices, product)
        measured = _measure_agreed(settings, measure, agree, with_split=True, stop_after_failure=True)
        measurements += measured
        if rounds == 1 or all(s.split == 1 for s in settings) or any(m.ok and m.setting.split > 1 for m in measured):
            break
        product, rounds = 2 * product, rounds + 1
        if per_device_batch(global_batch, devices) % product:
            break
    return measurements


def run_split_search(
    measure: Measure,
    agree: Agree,
    *,
    global_batch: int,
    devices: int,
    max_micro_batch: int,
    current_split: Optional[int],
    max_candidates: int = 4,
) -> SplitResult:
    """The seed's search, measured (see module docstring). ``max_micro_batch`` is the probe's (agreed) largest
    micro-batch at the model's current split factor; ``current_split`` is ``None`` for models without one.

    Without a split factor: time the ``max_candidates`` largest fitting micro-batches among the divisors of the
    per-device batch and keep the fastest. With one: seed steps 2–3 (and the special case), measured.
    """
    result = SplitResult(global_batch, devices, current_split is not None, None, None)
    per_device_batch(global_batch, devices)
    if current_split is None:
        settings = accumulation_settings(global_batch, devices, max_micro_batch)[:max_candidates]
        result.measurements = _measure_agreed(settings, measure, agree, with_split=False, stop_after_failure=False)
    else:
        if current_split == 1:
            base = smallest_fitting_accumulation(global_batch, devices, max_micro_batch)
        else:
            base = _agreed_base_accumulation(global_batch, devices, max_micro_batch, measure, agree)
        result.measurements = _trade_accumulation_for_split(measure, agree, global_batch, devices, base)
    best = choose_fastest(result.measurements, devices)
    if best is not None:
        result.best, result.samples_per_s = best.setting, best.samples_per_s(devices)
    return result
