"""The probe's settings: one :class:`ProbeConfig`, validated in one place, shared by every entry point.

    config = ProbeConfig(memory_budget_bytes=8 * 2**30, throughput_sizes=(64, 128))
    probe_micro_batch(model, optimizer, batch, config=config)
    probe_micro_batch(model, optimizer, batch, memory_budget_bytes=8 * 2**30)   # the same, as keywords
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Mapping, Optional

DEFAULT_FIT_SIZES = (2, 8, 32)
DEFAULT_MAX_BATCH_SIZE = 65536
MEASURES = ("auto", "cuda", "accounting")


@dataclass(frozen=True)
class ProbeConfig:
    """What the probe searches and measures.

    Attributes:
        memory_budget_bytes: the budget (default: the device's free memory: CUDA free + this process's cache;
            on CPU the available system memory).
        headroom: usable fraction of the budget (allocator fragmentation, other processes, spikes).
        fit_sizes: sizes measured for the linear memory fit (it stops at the first that fails).
        max_batch_size: upper bound on the answer (``ProbeResult.capped`` says when it, not memory, was the limit).
        rel_tol: bisection stops once the gap below the smallest failing size is ``≤ max(1, rel_tol·lo)``.
        measure: ``"cuda"`` (allocator peak), ``"accounting"`` (any device), ``"auto"`` (CUDA if on CUDA).
            Under the accounting, exceeding the budget counts as an OOM (a simulated one).
        throughput: time micro-batches at ``throughput_sizes`` (default: the maximum and the largest powers of
            two below it, 4 sizes); off, the agreed maximum is only confirmed.
        warmup_steps: untimed steps per size before timing (the memory-measured step is the first).
        timed_steps: timed steps per size, at least (6 give a 95% interval for the median step time).
        max_timed_steps: timed steps per size, at most (a bound for near-instant steps; the budget binds first).
        timing_precision: timing stops early, once half the budget is spent, for a size whose median step time
            is known to this relative precision (95% interval half-width over the median). Strict, and not
            checked earlier, on purpose: on a shared machine an interval over a short window can look tight
            between two bursts of load, and runs then disagree (benchmarks/RESULTS.md, "Probe repeatability").
        timing_budget_s: seconds of timing for all throughput sizes together, once each has ``timed_steps``
            (sizes are timed round-robin, so a burst of load on a shared machine hits them alike); each setting
            the split search measures gets a quarter of it. The timing costs between half the budget and
            ``max(timing_budget_s, (warmup_steps − 1 + timed_steps) × Σ step time)`` plus one round; the
            memory search adds one step per trial (at most ``max_trials``, typically 4–8).
        max_trials: cap on memory-search trials.
        max_copy_bytes: module attributes holding more tensor/array bytes than this are not copied for the
            restore (:mod:`gns_callback.probe.attributes`); if a probe step changes one, it is reported.
        progress_bar: a tqdm bar on rank zero while probing.
        verbose: log :meth:`ProbeResult.summary` on rank zero.
    """

    memory_budget_bytes: Optional[int] = None
    headroom: float = 0.85
    fit_sizes: tuple[int, ...] = DEFAULT_FIT_SIZES
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    rel_tol: float = 0.05
    measure: str = "auto"
    throughput: bool = True
    throughput_sizes: Optional[tuple[int, ...]] = None
    warmup_steps: int = 1
    timed_steps: int = 6
    max_timed_steps: int = 10_000
    timing_precision: float = 0.01
    timing_budget_s: float = 2.0
    max_trials: int = 40
    max_copy_bytes: int = 2**29
    progress_bar: bool = True
    verbose: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "fit_sizes", _sizes("fit_sizes", self.fit_sizes))
        if self.throughput_sizes is not None:
            object.__setattr__(self, "throughput_sizes", _sizes("throughput_sizes", self.throughput_sizes))
        if not self.fit_sizes:
            raise ValueError("fit_sizes=(): give one or more positive sizes, e.g. (2, 8, 32).")
        budget = self.memory_budget_bytes
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
            raise ValueError(f"memory_budget_bytes={budget!r}: a positive number of bytes, or None (the device's).")
        if not 0.0 < self.headroom <= 1.0:
            raise ValueError(f"headroom={self.headroom!r}: the usable fraction of the budget, in (0, 1].")
        _positive_int("max_batch_size", self.max_batch_size)
        if not 0.0 <= self.rel_tol < 1.0:
            raise ValueError(f"rel_tol={self.rel_tol!r}: the bisection's relative tolerance, in [0, 1).")
        if self.measure not in MEASURES:
            raise ValueError(f"measure={self.measure!r}: one of {', '.join(MEASURES)}.")
        for name in ("warmup_steps", "timed_steps", "max_timed_steps", "max_trials", "max_copy_bytes"):
            _positive_int(name, getattr(self, name))
        if self.max_timed_steps < self.timed_steps:
            raise ValueError(f"max_timed_steps={self.max_timed_steps!r}: at least timed_steps={self.timed_steps}.")
        if not self.timing_budget_s >= 0:
            raise ValueError(f"timing_budget_s={self.timing_budget_s!r}: seconds, 0 or more.")
        if not 0.0 < self.timing_precision < 1.0:
            raise ValueError(f"timing_precision={self.timing_precision!r}: a relative precision in (0, 1), e.g. 0.03.")


def _positive_int(name: str, value: Any) -> int:
    try:
        number = operator.index(value)
    except TypeError:
        number = 0
    if isinstance(value, bool) or number < 1:
        raise ValueError(f"{name}={value!r}: a positive int.")
    return number


def _sizes(name: str, sizes: Any) -> tuple[int, ...]:
    try:
        values = tuple(sizes)
    except TypeError:
        raise ValueError(f"{name}={sizes!r}: a sequence of positive ints, e.g. (2, 8, 32).") from None
    return tuple(_positive_int(f"{name} entry", size) for size in values)


def make_config(config: Optional[ProbeConfig] = None, overrides: Optional[Mapping[str, Any]] = None) -> ProbeConfig:
    """``config`` (default: ``ProbeConfig()``) with ``overrides`` applied; unknown names raise ``TypeError``."""
    base = ProbeConfig() if config is None else config
    if not isinstance(base, ProbeConfig):
        raise TypeError(f"config={config!r}: a ProbeConfig, or None for the defaults.")
    overrides = dict(overrides or {})
    known = {f.name for f in dataclasses.fields(ProbeConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown probe setting(s) {', '.join(unknown)}; ProbeConfig takes {', '.join(sorted(known))}.")
    return dataclasses.replace(base, **overrides) if overrides else base
