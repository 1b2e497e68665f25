"""Hardware probe: the largest micro-batch that fits, and throughput per micro-batch size, without crashing or
changing the run.

    from gns_callback.probe import probe_micro_batch, probe_trainer

    result = probe_micro_batch(model, optimizer, batch, memory_budget_bytes=8 * 2**30)
    result.max_micro_batch, result.throughput          # e.g. 412, {64: 5.1e3, 128: 7.9e3, 256: 9.0e3, 412: 9.2e3}

    # inside a callback hook, on every rank, with the batch Lightning passed in:
    result = probe_trainer(trainer, pl_module, batch)

Layout (pure math apart from glue): :mod:`~gns_callback.probe.memory_model` (linear fit, prediction, bisection
plan; no torch), :mod:`~gns_callback.probe.oom` (``is_oom``), :mod:`~gns_callback.probe.accounting` (bytes of
a step), :mod:`~gns_callback.probe.state` (snapshot/restore), :mod:`~gns_callback.probe.split` (split-factor
and accumulation search), :mod:`~gns_callback.probe.runner` (trials and entry points),
:mod:`~gns_callback.probe.result` (``ProbeResult``).
"""

from gns_callback.probe.accounting import SavedTensorsMeter, static_bytes
from gns_callback.probe.memory_model import LinearMemoryModel, fit_linear, next_trial, throughput_ladder
from gns_callback.probe.oom import ProbeFailedOnOtherRank, is_oom
from gns_callback.probe.result import ProbeResult, Trial
from gns_callback.probe.runner import (
    ProbeConfig,
    default_step,
    lightning_step,
    measure_micro_batch,
    probe_micro_batch,
    probe_trainer,
    resize_batch,
)
from gns_callback.probe.split import (
    SplitMeasurement,
    SplitResult,
    SplitSetting,
    accumulation_settings,
    choose_fastest,
    run_split_search,
    split_settings,
)
from gns_callback.probe.state import preserved_state

__all__ = [
    "LinearMemoryModel",
    "ProbeConfig",
    "ProbeFailedOnOtherRank",
    "ProbeResult",
    "SavedTensorsMeter",
    "SplitMeasurement",
    "SplitResult",
    "SplitSetting",
    "Trial",
    "accumulation_settings",
    "choose_fastest",
    "default_step",
    "fit_linear",
    "is_oom",
    "lightning_step",
    "measure_micro_batch",
    "next_trial",
    "preserved_state",
    "probe_micro_batch",
    "probe_trainer",
    "resize_batch",
    "run_split_search",
    "split_settings",
    "static_bytes",
    "throughput_ladder",
]
