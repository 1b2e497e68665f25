"""What the batch is for: ``"balanced"`` (the knee), ``"time"`` (the least wall time) or ``"cost"`` (the fewest
device-hours), each with steps, examples, time and device-hours predicted relative to the current setting.

The model. To reach a given loss, a global batch ``B`` takes ``S = S_min(1 + B_noise/B)`` optimizer steps and
``E = E_min(1 + B/B_noise)`` examples (McCandlish, Kaplan, Amodei 2018, "An Empirical Model of Large-Batch
Training"; ``E_min = S_min·B_noise``). A configuration ``B = m·a·D`` (micro-batch ``m``, ``a`` accumulated
micro-batches, ``D`` devices) spends ``t(m)`` seconds per micro-batch, the probe's measured median step time
(``m`` over its samples/s, linear in ``m`` between measured sizes: :class:`StepTimes`), so:

    wall time         T = S · a·t(m)         = S_min (1 + B_noise/B) · a·t(m)
    device-hours      C = D · T              = E_min (1 + B/B_noise) · t(m)/m

Accumulation adds no throughput on a device (``a`` micro-batches take ``a·t(m)``; this counts the optimizer step
``a`` times, pessimistic by ``(a−1)·t_opt``), and devices run in parallel at no communication cost (not measured:
a note says so). The objectives:

* ``"balanced"``: ``B ≈ B_noise``, where ``S/S_min = E/E_min = 2`` (:mod:`.batch`; no timing needed);
* ``"time"``: least ``T``. With ``t(m) = t0 + c·m``, ``a = 1`` and ``D`` devices, ``T ∝ (1 + B_noise/B)(t0 + c·B/D)``
  is least at ``B = √(B_noise·t0·D/c)``: above the knee when the per-step overhead ``t0`` is large, and at the
  smallest batch when throughput is flat (``t0 = 0``: then ``T ∝ E``). Past the micro-batch cap ``a·t(m)`` grows
  with ``B``, so accumulation never pays on one device;
* ``"cost"``: least ``C``. ``C`` depends on ``B`` and ``m`` only, so extra devices never lower it; at a fixed
  device count ``C = D·T`` and "cost" is "time". With ``max_devices`` the count may vary: "time" takes the most
  devices (``B = √(B_noise·t0·D/c)``), "cost" the fewest that reach its batch (ties go to fewer devices, then
  fewer accumulation steps).

Predictions are ratios to the current configuration, at ``B_noise`` and at both ends of its interval (each ratio
is monotone in ``B_noise``, so the ends bound it). Pure Python: no Lightning.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterable, Mapping, Optional

from gns_callback.json_values import json_safe
from gns_callback.recommendation.batch import Bounds, Grid, nearest_splitting
from gns_callback.recommendation.sizing import candidates, split

BALANCED, TIME, COST = "balanced", "time", "cost"
OBJECTIVES = (BALANCED, TIME, COST)
#: What each objective minimises, for tables and errors.
GOALS = {BALANCED: "the knee B ≈ B_noise (2× the minimum steps and examples)",
         TIME: "the least predicted wall time to the same loss", COST: "the fewest predicted device-hours"}
#: Plan statuses: computed; no step time measured; the estimate is not trusted (the current batch is kept).
OK, NOT_MEASURED, KEPT = "ok", "not_measured", "kept"
#: Targets per factor of two scanned for the "time"/"cost" optimum, then the nearest grid sizes are refined.
_PER_OCTAVE = 16
_REFINE = 24
_TIE = 1e-9


@dataclass(frozen=True)
class Config:
    """``batch_size = micro_batch_size × accumulate × num_devices``."""

    batch_size: int
    micro_batch_size: int
    accumulate: int
    num_devices: int


@dataclass(frozen=True)
class Ratio:
    """A prediction relative to the current setting at ``B_noise`` (``value``) and over its interval
    (``low ≤ high``; ``nan`` where the interval is unknown)."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))

    @classmethod
    def from_dict(cls, data: Optional[Mapping[str, Any]]) -> Optional["Ratio"]:
        if data is None:
            return None
        return cls(*(math.nan if data.get(k) is None else float(data[k]) for k in ("value", "low", "high")))


@dataclass(frozen=True)
class StepTimes:
    """Seconds per micro-batch step ``t(m)`` from a measured ``{micro: samples/s per device}`` table.

    ``t(m_i) = m_i/throughput(m_i)`` at the measured sizes, linear in ``m`` between them (exact for the usual
    ``t(m) = t0 + c·m``: a fixed per-step overhead plus a per-example cost), constant below the smallest (the
    pessimistic assumption for small batches, as :func:`~gns_callback.recommendation.tradeoff.throughput_at`),
    proportional to ``m`` above the largest (saturated: flat throughput).

    >>> times = StepTimes({16: 800.0, 32: 1280.0})
    >>> times.seconds(16), times.seconds(24), times.seconds(8), times.seconds(64)
    (0.02, 0.0225, 0.02, 0.05)
    """

    throughput: Mapping[int, float]

    @property
    def points(self) -> list[tuple[int, float]]:
        """``(m, t(m))`` at the measured sizes, increasing."""
        rates = ((int(m), float(v)) for m, v in self.throughput.items() if v is not None)
        return sorted((m, m / v) for m, v in rates if m > 0 and math.isfinite(v) and v > 0)

    @property
    def measured(self) -> bool:
        return bool(self.points)

    def seconds(self, micro_batch_size: float) -> float:
        """``t(m)`` (``nan`` when nothing was measured)."""
        points = self.points
        if not points:
            return math.nan
        (m0, t0), (m1, t1) = points[0], points[-1]
        if micro_batch_size <= m0:
            return t0
        if micro_batch_size >= m1:
            return t1 * micro_batch_size / m1
        for (a, ta), (b, tb) in zip(points, points[1:]):
            if a <= micro_batch_size <= b:
                return ta + (tb - ta) * (micro_batch_size - a) / (b - a)
        return math.nan  # unreachable


@dataclass(frozen=True)
class ObjectivePlan:
    """The configuration an objective picks and its predictions relative to the current setting.

    Attributes:
        objective: one of :data:`OBJECTIVES`; ``status``: :data:`OK`, :data:`NOT_MEASURED` (no step time:
            ``reason`` says what to pass) or :data:`KEPT` (the estimate is not trusted: the current batch).
        batch_size, micro_batch_size, accumulate_grad_batches, num_devices: the configuration (``None``: not
            measured); ``learning_rate`` by the recommendation's LR rule at that batch.
        steps, examples: ``S/S_current``, ``E/E_current``; ``time``, ``device_hours``: ``T/T_current``,
            ``C/C_current`` (``None`` without step times). Each a :class:`Ratio` over the ``B_noise`` interval.
    """

    objective: str
    status: str
    reason: str = ""
    batch_size: Optional[int] = None
    micro_batch_size: Optional[int] = None
    accumulate_grad_batches: Optional[int] = None
    num_devices: Optional[int] = None
    learning_rate: Optional[float] = None
    steps: Optional[Ratio] = None
    examples: Optional[Ratio] = None
    time: Optional[Ratio] = None
    device_hours: Optional[Ratio] = None

    @property
    def config(self) -> Optional[Config]:
        if self.batch_size is None:
            return None
        return Config(self.batch_size, self.micro_batch_size, self.accumulate_grad_batches, self.num_devices)

    def to_dict(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k not in ("steps", "examples", "time", "device_hours")}
        for name in ("steps", "examples", "time", "device_hours"):
            value = getattr(self, name)
            data[name] = None if value is None else value.to_dict()
        return json_safe(data)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ObjectivePlan":
        ratios = {name: Ratio.from_dict(data.get(name)) for name in ("steps", "examples", "time", "device_hours")}
        plain = {k: data.get(k) for k in ("objective", "status", "reason", "batch_size", "micro_batch_size",
                                          "accumulate_grad_batches", "num_devices", "learning_rate")}
        return cls(**{**plain, "reason": plain["reason"] or ""}, **ratios)


@dataclass(frozen=True)
class Search:
    """Where "time"/"cost" look: batch ``bounds`` on the ``grid``, split under ``micro_cap`` over ``devices``."""

    bounds: Bounds
    grid: Grid
    micro_cap: Optional[int]
    devices: tuple[int, ...]


def check_objective(objective: str, max_devices: Optional[int]) -> None:
    """A clear error for an unknown objective or a non-positive ``max_devices``."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {', '.join(map(repr, OBJECTIVES))}, got {objective!r}; "
                         "e.g. objective='balanced' (the knee) or 'time' (needs the probe's step times)")
    if max_devices is not None and (isinstance(max_devices, bool) or not isinstance(max_devices, int)
                                    or max_devices < 1):
        raise ValueError(f"max_devices must be a positive int (the most devices you could use, e.g. 8) or None to "
                         f"keep the current device count, got {max_devices!r}")


def device_counts(num_devices: int, max_devices: Optional[int]) -> tuple[int, ...]:
    """The device counts to consider: the current one, or with ``max_devices`` the powers of two up to it, the
    current count (when not above it) and ``max_devices`` itself.

    >>> device_counts(2, None), device_counts(3, 8)
    ((2,), (1, 2, 3, 4, 8))
    """
    if max_devices is None:
        return (num_devices,)
    counts = {2**k for k in range(max_devices.bit_length()) if 2**k <= max_devices} | {max_devices}
    if num_devices <= max_devices:
        counts.add(num_devices)
    return tuple(sorted(counts))


# ---------------------------------------------------------------------------------------------- the model
def steps_ratio(batch: float, current: float, b_noise: float) -> float:
    """``S(B)/S(B_current) = (1 + B_noise/B)/(1 + B_noise/B_current)``; ``B_current/B`` for an unbounded
    ``B_noise``.

    >>> steps_ratio(200, 100, 100), steps_ratio(200, 100, math.inf)
    (0.75, 0.5)
    """
    if math.isnan(b_noise):
        return math.nan
    if math.isinf(b_noise):
        return current / batch
    bn = max(b_noise, 0.0)
    return (1.0 + bn / batch) / (1.0 + bn / current)


def examples_ratio(batch: float, current: float, b_noise: float) -> float:
    """``E(B)/E(B_current) = (B_noise + B)/(B_noise + B_current)``; ``1`` for an unbounded ``B_noise``.

    >>> examples_ratio(200, 100, 100), examples_ratio(200, 100, 0.0)
    (1.5, 2.0)
    """
    if math.isnan(b_noise):
        return math.nan
    if math.isinf(b_noise):
        return 1.0
    bn = max(b_noise, 0.0)
    return (bn + batch) / (bn + current)


def step_seconds(config: Config, times: StepTimes) -> float:
    """Seconds per optimizer step, ``a·t(m)`` (accumulation adds no throughput; devices run in parallel)."""
    return config.accumulate * times.seconds(config.micro_batch_size)


def wall_time(config: Config, b_noise: float, times: StepTimes) -> float:
    """``T/S_min = (1 + B_noise/B)·a·t(m)``."""
    return (1.0 + max(b_noise, 0.0) / config.batch_size) * step_seconds(config, times)


def device_time(config: Config, b_noise: float, times: StepTimes) -> float:
    """``C/E_min = (1 + B/B_noise)·t(m)/m`` (device-seconds per minimal example; independent of ``a`` and ``D``).

    Equals ``D·T/E_min``: ``D·S·a·t(m)`` with ``D·a = B/m`` and ``E_min = S_min·B_noise``."""
    if not b_noise > 0:
        return math.inf
    return (1.0 + config.batch_size / b_noise) * times.seconds(config.micro_batch_size) / config.micro_batch_size


def _over_interval(ratio: Any, b_noise: float, ci_low: float, ci_high: float) -> Ratio:
    """``ratio(B_noise)`` and its range over ``[ci_low, ci_high]`` (monotone in ``B_noise``: the ends bound it)."""
    ends = [ratio(ci_low), ratio(ci_high)]
    if any(math.isnan(e) for e in ends):
        return Ratio(ratio(b_noise), math.nan, math.nan)
    return Ratio(ratio(b_noise), min(ends), max(ends))


def predict(config: Config, current: Config, b_noise: float, ci_low: float, ci_high: float,
            times: Optional[StepTimes]) -> dict[str, Optional[Ratio]]:
    """``steps``, ``examples``, ``time`` and ``device_hours`` of ``config`` relative to ``current``, each a
    :class:`Ratio` over the ``B_noise`` interval (time and device-hours ``None`` without step times)."""
    if config == current:
        same = Ratio(1.0, 1.0, 1.0)
        timed = times is not None and times.measured
        return {"steps": same, "examples": same, "time": same if timed else None,
                "device_hours": same if timed else None}
    b, c = config.batch_size, current.batch_size
    out: dict[str, Optional[Ratio]] = {
        "steps": _over_interval(lambda bn: steps_ratio(b, c, bn), b_noise, ci_low, ci_high),
        "examples": _over_interval(lambda bn: examples_ratio(b, c, bn), b_noise, ci_low, ci_high),
        "time": None,
        "device_hours": None,
    }
    if times is None or not times.measured:
        return out
    per_step = step_seconds(config, times) / step_seconds(current, times)
    devices = config.num_devices / current.num_devices
    out["time"] = _over_interval(lambda bn: steps_ratio(b, c, bn) * per_step, b_noise, ci_low, ci_high)
    out["device_hours"] = _over_interval(lambda bn: steps_ratio(b, c, bn) * per_step * devices, b_noise, ci_low,
                                         ci_high)
    return out


# ---------------------------------------------------------------------------------------------- the search
def candidate_configs(search: Search, b_noise: float, current: Config) -> list[Config]:
    """Configurations to compare: for each device count, the nearest splitting grid size to targets spaced
    ``2^(1/16)`` apart, from the lower bound to ``4×`` the largest single-micro-batch size (past it ``a·t(m)``
    grows with ``B``), the current batch and ``B_noise`` (clipped to the upper bound)."""
    lo, hi = search.bounds.lo, search.bounds.hi
    cap = search.micro_cap or current.micro_batch_size
    ends = [4.0 * cap * max(search.devices), 2.0 * current.batch_size]
    if math.isfinite(b_noise):
        ends.append(2.0 * b_noise)
    top = min(hi, max(ends))
    octaves = max(math.log2(max(top, lo) / lo), 0.0)
    targets = [lo * 2 ** (k / _PER_OCTAVE) for k in range(int(octaves * _PER_OCTAVE) + 1)] + [top]
    found: dict[Config, None] = {}
    for devices in search.devices:
        for target in targets:
            size, (micro, accum), _ = nearest_splitting(target, lo, hi, devices, search.micro_cap, search.grid)
            found[Config(size, micro, accum, devices)] = None
    return list(found)


def neighbours(config: Config, search: Search) -> list[Config]:
    """The grid sizes nearest ``config``'s batch, split over its devices (the refinement of the scan)."""
    step = search.grid.multiple_of
    near = candidates(config.batch_size, search.bounds.lo, search.bounds.hi, step, search.grid.power_of_two)
    out = []
    for _, size in zip(range(_REFINE), near):
        parts = split(size, config.num_devices, search.micro_cap) or split(
            size, config.num_devices, search.micro_cap, strict=False)
        if parts is not None:
            out.append(Config(size, parts[0], parts[1], config.num_devices))
    return out


def _cost_function(objective: str):
    return wall_time if objective == TIME else device_time


def _tie_break(objective: str, config: Config) -> tuple:
    """Among equal predictions: "time" prefers fewer examples (smaller ``B``), then fewer devices; "cost"
    prefers fewer devices, then fewer accumulation steps, then more devices' worth of speed (larger ``B``)."""
    if objective == TIME:
        return (config.batch_size, config.num_devices, config.accumulate)
    return (config.num_devices, config.accumulate, config.batch_size)


def best(objective: str, configs: Iterable[Config], b_noise: float, times: StepTimes) -> Config:
    """The configuration with the least predicted time (``"time"``) or device-hours (``"cost"``)."""
    value = _cost_function(objective)
    scored = [(value(c, b_noise, times), c) for c in configs]
    scored = [(v, c) for v, c in scored if math.isfinite(v)]
    if not scored:
        raise ValueError(f"no configuration has a finite predicted {objective} (B_noise = {b_noise!r})")
    least = min(v for v, _ in scored)
    tied = [c for v, c in scored if v <= least * (1.0 + _TIE)]
    return min(tied, key=lambda c: _tie_break(objective, c))


def optimise(objective: str, search: Search, b_noise: float, times: StepTimes, current: Config) -> Config:
    """:func:`best` over the scan (:func:`candidate_configs`), then over the grid sizes next to the winner."""
    first = best(objective, candidate_configs(search, b_noise, current), b_noise, times)
    return best(objective, [first, *neighbours(first, search)], b_noise, times)


# ---------------------------------------------------------------------------------------------- the plans
def plan(objective: str, config: Config, current: Config, b_noise: float, ci_low: float, ci_high: float,
         times: Optional[StepTimes], status: str = OK, reason: str = "") -> ObjectivePlan:
    """An :class:`ObjectivePlan` for ``config`` with its predictions relative to ``current``."""
    return ObjectivePlan(objective, status, reason, config.batch_size, config.micro_batch_size, config.accumulate,
                         config.num_devices, None, **predict(config, current, b_noise, ci_low, ci_high, times))


def not_measured(objective: str, probe_given: bool) -> ObjectivePlan:
    """The plan of an objective that needs step times when none were measured, saying what to pass."""
    if probe_given:
        why = "the probe measured no step time (see its error); rerun it, or pass throughput={micro: samples/s}"
    else:
        why = ("no step time: pass probe=True to the callback (or probe=/throughput= to recommend()), "
               "or use objective='balanced'")
    return ObjectivePlan(objective, NOT_MEASURED, f"objective={objective!r} needs the probe's step times: {why}")


def objective_plans(
    trusted: bool,
    reason: str,
    b_noise: float,
    ci_low: float,
    ci_high: float,
    balanced: Config,
    current: Config,
    search: Search,
    times: Optional[StepTimes],
    probe_given: bool,
) -> dict[str, ObjectivePlan]:
    """The three plans. ``balanced`` is the knee's configuration (chosen by :mod:`.batch`); "time" and "cost" are
    optimised over ``search`` when the estimate is ``trusted`` and step times were measured, else kept at the
    current configuration (``reason``: why the estimate is not trusted) or :func:`not_measured`."""
    plans = {BALANCED: plan(BALANCED, balanced, current, b_noise, ci_low, ci_high, times)}
    for objective in (TIME, COST):
        if times is None or not times.measured:
            plans[objective] = not_measured(objective, probe_given)
        elif not trusted:
            plans[objective] = plan(objective, current, current, b_noise, ci_low, ci_high, times, KEPT, reason)
        else:
            chosen = optimise(objective, search, b_noise, times, current)
            plans[objective] = plan(objective, chosen, current, b_noise, ci_low, ci_high, times)
    return plans


def with_learning_rates(plans: Mapping[str, ObjectivePlan], lr_at: Any) -> dict[str, ObjectivePlan]:
    """Each plan with ``learning_rate = lr_at(batch_size)`` (the recommendation's LR rule)."""
    return {name: p if p.batch_size is None else replace(p, learning_rate=lr_at(p.batch_size))
            for name, p in plans.items()}


def time_curve(batch_sizes: Iterable[float], b_noise: float, current: Config, times: StepTimes,
               micro_cap: Optional[int]) -> list[float]:
    """``T(B)/T(current)`` on ``current``'s devices, ``B`` read as a continuous size: one micro-batch per device up
    to ``micro_cap``, then the fewest equal micro-batches under it (what the plots draw; the plans themselves are
    on the size grid).

    >>> t = StepTimes({8: 8 / (0.01 + 8e-4), 4096: 4096 / (0.01 + 4096e-4)})
    >>> [round(r, 4) for r in time_curve([100, 200], 400.0, Config(100, 100, 1, 1), t, None)]
    [1.0, 0.9]
    """
    reference = wall_time(current, b_noise, times)
    devices = current.num_devices
    out = []
    for batch in batch_sizes:
        share = batch / devices
        accumulate = 1 if micro_cap is None else max(1, math.ceil(share / micro_cap - 1e-9))
        seconds = accumulate * times.seconds(share / accumulate)
        out.append((1.0 + max(b_noise, 0.0) / batch) * seconds / reference)
    return out
