"""gns_callback: measure the gradient noise scale while training with PyTorch Lightning.

    trainer = pl.Trainer(callbacks=[GradientNoiseScaleCallback()], accumulate_grad_batches=4)
    trainer.fit(model)
    print(trainer.callbacks[0].estimate)   # B_simple with its 95% interval
"""

from gns_callback.callback import GradientNoiseScaleCallback
from gns_callback.estimate import GNSEstimate
from gns_callback.estimators import effective_batch_size, grad_sq_norm_estimate, trace_sigma_estimate
from gns_callback.probe import ProbeResult, probe_micro_batch
from gns_callback.recommendation import Recommendation, recommend
from gns_callback.report import load_estimate, read_report

__version__ = "0.1.0"

__all__ = [
    "GNSEstimate",
    "GradientNoiseScaleCallback",
    "ProbeResult",
    "Recommendation",
    "effective_batch_size",
    "grad_sq_norm_estimate",
    "load_estimate",
    "probe_micro_batch",
    "read_report",
    "recommend",
    "trace_sigma_estimate",
]
