"""gns_callback: measure the gradient noise scale while training, and recommend a batch size and learning rate.

    trainer = pl.Trainer(callbacks=[GradientNoiseScaleCallback()])     # with Lightning
    trainer.fit(model)
    print(trainer.callbacks[0].estimate)   # B_simple with its 95% interval

    with GradientNoiseScaleMeter(model) as meter:                       # any training loop
        ...; loss.backward(); meter.step(); optimizer.step(); optimizer.zero_grad()

Names are imported lazily: ``import gns_callback`` (and ``gns_callback.meter``) needs no Lightning package; only
``GradientNoiseScaleCallback`` imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_LAZY = {
    "GradientNoiseScaleCallback": "gns_callback.callback",
    "GradientNoiseScaleMeter": "gns_callback.meter",
    "GNSEstimate": "gns_callback.estimate",
    "effective_batch_size": "gns_callback.estimators",
    "grad_sq_norm_estimate": "gns_callback.estimators",
    "trace_sigma_estimate": "gns_callback.estimators",
    "ProbeResult": "gns_callback.probe",
    "probe_micro_batch": "gns_callback.probe",
    "Recommendation": "gns_callback.recommendation",
    "recommend": "gns_callback.recommendation",
    "load_estimate": "gns_callback.report",
    "read_report": "gns_callback.report",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'gns_callback' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
