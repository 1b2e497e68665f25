"""The few non-arithmetic operations of the per-step formulas, on device tensors or on host scalars.

A step's estimates (:func:`gns_callback.accumulation.step_estimates`, :class:`gns_callback.blend.PairBlend`) are
a few dozen scalar operations. On an accelerator they stay on the device as 0-d tensors, so that no step waits
for a host sync. On the CPU, with one process, each 0-d tensor operation costs microseconds of dispatch for one
flop; there the same formulas run on NumPy ``float64`` scalars (IEEE arithmetic, so every ``+ − × ÷`` rounds as
the tensor operation does, and a division by zero gives ``inf``/``nan`` instead of raising). Sums over several
values may round differently (a BLAS dot's order), by an ulp.

The formulas are written once, with ``+ − × ÷`` and comparisons, and take one of :data:`TORCH` or :data:`HOST`
for ``where``, ``isfinite`` and clamping. Squares are written as products: ``x * x`` is what ``torch.pow(x, 2)``
computes, and is exact to the bit on both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch


@dataclass(frozen=True)
class ScalarOps:
    """``where(cond, a, b)``, ``isfinite(x)``, ``clamp_min(x, low)``, ``clamp(x, low, high)`` of one kind of
    value; ``nan`` passes through the clamps on both kinds."""

    name: str
    where: Callable[[Any, Any, Any], Any]
    isfinite: Callable[[Any], Any]
    clamp_min: Callable[[Any, float], Any]
    clamp: Callable[[Any, float, float], Any]


def _host_clamp_min(x: Any, low: float) -> Any:
    return low if low > x else x  # nan > ... is False: nan stays nan, as torch.clamp_min


def _host_clamp(x: Any, low: float, high: float) -> Any:
    x = _host_clamp_min(x, low)
    return high if x > high else x


#: 0-d tensors, on any device (no host sync).
TORCH = ScalarOps("torch", torch.where, torch.isfinite, torch.clamp_min, torch.clamp)
#: NumPy ``float64`` scalars on the host (Python ``bool`` conditions); run inside :func:`host_errors_ignored`.
HOST = ScalarOps("host", lambda cond, a, b: a if cond else b, math.isfinite, _host_clamp_min, _host_clamp)


def host_errors_ignored() -> Any:
    """Context in which NumPy scalar overflow and division by zero give ``inf``/``nan`` silently, as tensors do."""
    return np.errstate(all="ignore")


__all__ = ["ScalarOps", "TORCH", "HOST", "host_errors_ignored"]
