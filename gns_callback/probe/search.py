"""The search: local memory search, agreement, confirmation and timing of the agreed sizes, split search.

1. Every rank searches alone (:func:`gns_callback.probe.memory_model.next_trial`: fit, predict, verify,
   extend, back off, bisect), with no collective inside a trial.
2. The ranks agree (:mod:`gns_callback.probe.agreement`): the smallest maximum and budget, the largest memory
   model.
3. Every rank runs the agreed maximum (and the throughput sizes below it) once, times them round-robin
   (:meth:`~gns_callback.probe.trial.TrialRunner.time_sizes`), and the ranks agree again: a size fits only if it
   fitted everywhere; timings are the slowest rank's.
4. Optionally, the split-factor / accumulation search (:mod:`gns_callback.probe.split`) for a global batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

from gns_callback.probe.agreement import Agree, agree_or_raise, agree_outcomes, as_largest, largest
from gns_callback.probe.config import ProbeConfig
from gns_callback.probe.memory_model import LinearMemoryModel, bracket, fit_linear, next_trial, throughput_ladder
from gns_callback.probe.result import ProbeResult, Trial
from gns_callback.probe.split import run_split_search
from gns_callback.probe.trial import TrialRunner


@dataclass(frozen=True)
class SplitRequest:
    """Run the split search for ``global_batch`` over ``devices``; ``current_split`` is the model's split
    factor (``None``: it has none)."""

    global_batch: int
    devices: int
    current_split: Optional[int]


@dataclass(frozen=True)
class AgreedMemory:
    """The memory search as all ranks agreed on it."""

    max_micro_batch: int
    budget_bytes: int
    fixed_bytes: Optional[float]
    bytes_per_sample: Optional[float]


def local_memory_search(
    runner: TrialRunner, config: ProbeConfig, limit: float
) -> tuple[list[Trial], Optional[Exception]]:
    """This rank's trials (fit, verify, extend, back off, bisect) until the planner is done; an error stops it and
    is returned, to be raised at the next agreement."""
    trials: list[Trial] = []
    try:
        while len(trials) < config.max_trials:
            proposal = next_trial(trials, fit_sizes=config.fit_sizes, limit_bytes=limit,
                                  cap=config.max_batch_size, rel_tol=config.rel_tol)
            if proposal is None:
                break
            trials.append(runner.run(*proposal))
    except Exception as exc:
        return trials, exc
    return trials, None


def _memory_model(trials: list[Trial]) -> Optional[LinearMemoryModel]:
    measured = [(t.size, t.measured_bytes) for t in trials if t.ok and t.measured_bytes is not None]
    return fit_linear([s for s, _ in measured], [b for _, b in measured]) if measured else None


def agree_memory(
    agree: Agree, trials: list[Trial], budget: int, cap: int, error: Optional[Exception]
) -> AgreedMemory:
    """The smallest maximum and budget over ranks, and the largest ``fixed`` and ``per_sample`` bytes."""
    model = _memory_model(trials)
    values = [
        float(bracket(trials, cap)[0]),
        float(budget),
        as_largest(model.fixed_bytes if model else None),
        as_largest(model.bytes_per_sample if model else None),
    ]
    size, agreed_budget, fixed, per_sample = agree_or_raise(agree, values, error)
    fixed, per_sample = largest(fixed), largest(per_sample)
    fitted = bool(fixed or per_sample)
    return AgreedMemory(int(size), int(agreed_budget), fixed if fitted else None, per_sample if fitted else None)


def candidate_sizes(config: ProbeConfig, agreed_max: int) -> list[int]:
    """Sizes to confirm (and time): the agreed maximum, and the throughput sizes up to it."""
    if agreed_max <= 0:
        return []
    if not config.throughput:
        return [agreed_max]
    if config.throughput_sizes is not None:
        return sorted({s for s in config.throughput_sizes if s <= agreed_max} | {agreed_max})
    return throughput_ladder(agreed_max)


def confirm_sizes(
    runner: TrialRunner, config: ProbeConfig, sizes: list[int]
) -> tuple[list[Optional[Trial]], Optional[Exception]]:
    """Run each size once on this rank (a size the memory search already ran is reused when nothing is timed);
    after an error the rest are not tried."""
    outcomes: list[Optional[Trial]] = []
    error: Optional[Exception] = None
    for size in sizes:
        done = next((t for t in runner.trials if t.size == size and t.ok and t.split is None), None)
        if error is not None:
            outcomes.append(None)
        elif not config.throughput and done is not None:
            outcomes.append(done)
        else:
            try:
                outcomes.append(runner.run(size, "throughput" if config.throughput else "confirm"))
            except Exception as exc:
                outcomes.append(None)
                error = exc
    return outcomes, error


def time_confirmed(runner: TrialRunner, config: ProbeConfig, trials: list[Optional[Trial]]) -> Optional[Exception]:
    """Repeated, interleaved timing of the trials that fitted (:meth:`TrialRunner.time_sizes`), into their
    ``timing``; a size that runs out of memory while timed no longer fits. Returns an error to agree on."""
    confirmed = [t for t in trials if t is not None and t.ok]
    if not confirmed:
        return None
    try:
        timings = runner.time_sizes([t.size for t in confirmed], config.timing_budget_s)
    except Exception as exc:
        return exc
    for trial in confirmed:
        trial.timing = timings[trial.size]
        if trial.timing is None:
            trial.ok, trial.error = False, "out of memory while timed"
    return None


def _result(
    runner: TrialRunner, config: ProbeConfig, memory: AgreedMemory, final_max: int, world_size: int
) -> ProbeResult:
    return ProbeResult(
        max_micro_batch=final_max,
        fixed_bytes=memory.fixed_bytes,
        bytes_per_sample=memory.bytes_per_sample,
        budget_bytes=memory.budget_bytes,
        headroom=config.headroom,
        device=str(runner.device),
        measure=runner.measure,
        trials=runner.trials,
        capped=final_max >= config.max_batch_size,
        world_size=world_size,
    )


def search(
    runner: TrialRunner,
    config: ProbeConfig,
    *,
    agree: Agree,
    world_size: int,
    budget: int,
    split_request: Optional[SplitRequest] = None,
) -> ProbeResult:
    """Steps 1–4 of the module docstring; every rank calls it and reaches the same agreements."""
    trials, error = local_memory_search(runner, config, config.headroom * budget)
    memory = agree_memory(agree, trials, budget, config.max_batch_size, error)
    sizes = candidate_sizes(config, memory.max_micro_batch)
    outcomes, error = confirm_sizes(runner, config, sizes)
    started = time.perf_counter()
    if config.throughput and error is None:
        error = time_confirmed(runner, config, outcomes)
    timing_seconds = time.perf_counter() - started
    agreed = agree_outcomes(agree, outcomes, error)
    final_max = max((s for s, a in zip(sizes, agreed) if a is not None and a.ok), default=0)
    result = _result(runner, config, memory, final_max, world_size)
    result.timings = {s: a.timing for s, a in zip(sizes, agreed) if a is not None and a.ok and a.timing is not None}
    result.timing_seconds = timing_seconds if config.throughput else None
    if split_request is not None:
        result.split = run_split_search(
            lambda micro, split: runner.run(micro, "split", timed=True, split=split),
            agree,
            global_batch=split_request.global_batch,
            devices=split_request.devices,
            max_micro_batch=final_max,
            current_split=split_request.current_split,
        )
    return result
