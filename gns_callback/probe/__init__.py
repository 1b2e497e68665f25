"""Hardware probe: the largest micro-batch that fits, and throughput per micro-batch size, without crashing or
changing the run.

    from gns_callback.probe import ProbeConfig, probe_micro_batch, probe_trainer

    result = probe_micro_batch(model, optimizer, batch, memory_budget_bytes=8 * 2**30)
    result.max_micro_batch, result.throughput          # e.g. 412, {64: 5.1e3, 128: 7.9e3, 256: 9.0e3, 412: 9.2e3}

    # inside a callback hook, on every rank, with the batch Lightning passed in:
    result = probe_trainer(trainer, pl_module, batch, config=ProbeConfig(headroom=0.8))

Layout. Pure (no Lightning; the first six not even torch): :mod:`~gns_callback.probe.config` (``ProbeConfig``),
:mod:`~gns_callback.probe.memory_model` (linear fit, bisection plan), :mod:`~gns_callback.probe.timing` (median
step time, its interval, ``faster``), :mod:`~gns_callback.probe.agreement`
(cross-rank agreement through a MIN reduce passed in), :mod:`~gns_callback.probe.split` (split-factor and
accumulation search), :mod:`~gns_callback.probe.result` (``ProbeResult``, ``Trial``),
:mod:`~gns_callback.probe.batches` (tiling), :mod:`~gns_callback.probe.oom` (``is_oom``),
:mod:`~gns_callback.probe.accounting` (bytes of a step), :mod:`~gns_callback.probe.state` (snapshot/restore;
module attributes such as metric states and lists in :mod:`~gns_callback.probe.attributes`),
:mod:`~gns_callback.probe.trial` (one trial), :mod:`~gns_callback.probe.search` (the search and its
agreements), :mod:`~gns_callback.probe.session` (budget, patches, state around a search),
:mod:`~gns_callback.probe.standalone` (``probe_micro_batch``). Lightning: :mod:`~gns_callback.probe.lightning`
(``probe_trainer``), imported on first use of its names.
"""

from typing import Any

from gns_callback.probe.accounting import SavedTensorsMeter, static_bytes
from gns_callback.probe.agreement import ProbeFailedOnOtherRank
from gns_callback.probe.batches import resize_batch
from gns_callback.probe.config import ProbeConfig
from gns_callback.probe.memory_model import LinearMemoryModel, fit_linear, next_trial, throughput_ladder
from gns_callback.probe.oom import is_oom
from gns_callback.probe.result import ProbeResult, Trial
from gns_callback.probe.split import (
    SplitMeasurement,
    SplitResult,
    SplitSetting,
    accumulation_settings,
    choose_fastest,
    divisors,
    run_split_search,
    split_settings,
)
from gns_callback.probe.standalone import default_step, measure_micro_batch, probe_micro_batch
from gns_callback.probe.state import preserved_state
from gns_callback.probe.timing import Timing, faster

_LIGHTNING_NAMES = ("SplitFactor", "lightning_step", "probe_trainer")


def __getattr__(name: str) -> Any:
    """The Lightning adapter's names, imported on first use (so the rest works without Lightning)."""
    if name in _LIGHTNING_NAMES:
        from gns_callback.probe import lightning

        return getattr(lightning, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LinearMemoryModel",
    "ProbeConfig",
    "ProbeFailedOnOtherRank",
    "ProbeResult",
    "SavedTensorsMeter",
    "SplitFactor",
    "SplitMeasurement",
    "SplitResult",
    "SplitSetting",
    "Timing",
    "Trial",
    "accumulation_settings",
    "choose_fastest",
    "default_step",
    "divisors",
    "faster",
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
