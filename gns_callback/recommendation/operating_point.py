"""An :class:`~gns_callback.recommendation.result.OperatingPoint`: what the model predicts for one configuration.

Steps and examples to a given loss relative to their minima, ``S/S_min = 1 + B_noise/B`` and
``E/E_min = 1 + B/B_noise`` (McCandlish et al. 2018), at ``B_simple`` and at both ends of its interval;
throughput from the probe's table at the micro-batch (times the devices); time and cost per epoch and to target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from gns_callback.recommendation.result import OperatingPoint
from gns_callback.recommendation.tradeoff import examples_factor, steps_factor, throughput_at
from gns_callback.recommendation.trust import EstimateView


@dataclass(frozen=True)
class Economics:
    """What turns a configuration into time and money: ``throughput`` (``{micro: samples/s per device}``),
    ``examples_per_epoch``, ``price_per_device_hour``; each may be unknown."""

    throughput: dict[int, float]
    examples_per_epoch: Optional[float]
    price_per_device_hour: Optional[float]


def operating_point(
    batch_size: int,
    micro_batch_size: Optional[int],
    accumulate: Optional[int],
    num_devices: int,
    learning_rate: Optional[float],
    est: EstimateView,
    econ: Economics,
) -> OperatingPoint:
    """The trade-off factors at ``B_simple`` and its interval, plus throughput, time and cost per epoch."""
    b, lo, hi = est.b_simple, est.ci_low, est.ci_high
    sps = throughput_at(econ.throughput, micro_batch_size) if (econ.throughput and micro_batch_size) else None
    sps = None if sps is None else sps * num_devices
    epe = econ.examples_per_epoch
    epoch_s = None if (sps is None or epe is None) else epe / sps
    cost = None
    if epoch_s is not None and econ.price_per_device_hour is not None:
        cost = econ.price_per_device_hour * num_devices * epoch_s / 3600.0
    return OperatingPoint(
        batch_size=batch_size,
        micro_batch_size=micro_batch_size,
        accumulate_grad_batches=accumulate,
        num_devices=num_devices,
        learning_rate=learning_rate,
        steps_factor=steps_factor(batch_size, b),
        examples_factor=examples_factor(batch_size, b),
        steps_factor_at_ci_low=steps_factor(batch_size, lo),
        steps_factor_at_ci_high=steps_factor(batch_size, hi),
        examples_factor_at_ci_low=examples_factor(batch_size, lo),
        examples_factor_at_ci_high=examples_factor(batch_size, hi),
        samples_per_sec=sps,
        steps_per_epoch=None if epe is None else math.ceil(epe / batch_size),
        epoch_seconds=epoch_s,
        cost_per_epoch=cost,
    )


def time_to_target_ratio(current: OperatingPoint, recommended: OperatingPoint) -> Optional[float]:
    """Predicted wall time to the same loss, recommended/current: ``(E/E_min)/throughput`` of each."""
    if not (current.samples_per_sec and recommended.samples_per_sec and math.isfinite(current.examples_factor)):
        return None
    mine = recommended.examples_factor / recommended.samples_per_sec
    return mine / (current.examples_factor / current.samples_per_sec)


def with_target(current: OperatingPoint, recommended: OperatingPoint, target_epochs: Optional[float]):
    """Both points with epochs, time and cost to target, given the epochs the *current* one needs: each point
    needs ``target_epochs·E(B)/E(B_current)`` (unchanged when a factor is not finite)."""
    ok = math.isfinite(current.examples_factor) and math.isfinite(recommended.examples_factor)
    if target_epochs is None or not ok:
        return current, recommended
    return tuple(_at(p, target_epochs * p.examples_factor / current.examples_factor) for p in (current, recommended))


def _at(p: OperatingPoint, epochs: float) -> OperatingPoint:
    time_s = None if p.epoch_seconds is None else epochs * p.epoch_seconds
    cost = None if p.cost_per_epoch is None else epochs * p.cost_per_epoch
    return replace(p, epochs_to_target=epochs, time_to_target_s=time_s, cost_to_target=cost)
