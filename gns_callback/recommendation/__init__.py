"""Batch-size and learning-rate recommendations from the gradient noise scale (pure Python, no Lightning).

    from gns_callback.recommendation import recommend
    rec = recommend(callback.run_estimate, current_batch_size=64, current_lr=0.1, optimizer=torch.optim.SGD)
    print(rec.summary_table())

Modules: :mod:`.tradeoff` (McCandlish et al.'s steps/examples factors, throughput interpolation),
:mod:`.sizing` (size grids, ``micro × accumulate × devices`` splits, the typed probe view), :mod:`.rules` (LR
scaling by optimizer family, warmup), :mod:`.result` (the ``Recommendation`` dataclass), :mod:`.core`
(``recommend``, a pipeline of the stages below), :mod:`.adapt` (hysteresis for opt-in adaptation during training).

Stages of ``recommend``: :mod:`.trust` (read the estimate, assess it), :mod:`.current` (the current split),
:mod:`.hardware` (micro-batch cap and throughput from the probe), :mod:`.batch` (choose the global batch and
split it), :mod:`.learning_rate` (rule, new LR, warmup), :mod:`.operating_point` (predictions per configuration),
:mod:`.objective` (``objective="balanced"/"time"/"cost"``: the three plans side by side).
"""

from gns_callback.recommendation.adapt import AdaptDecision, AdaptPolicy
from gns_callback.recommendation.core import assess, recommend
from gns_callback.recommendation.objective import OBJECTIVES, ObjectivePlan, Ratio
from gns_callback.recommendation.result import STATUSES, OperatingPoint, Recommendation
from gns_callback.recommendation.rules import (
    lr_rule_for,
    optimizer_name,
    scale_lr,
    warmup_epochs_for,
    warmup_lambda,
    warmup_lr,
)
from gns_callback.recommendation.sizing import ProbeSummary, ProbeView, candidates, probe_inputs, split
from gns_callback.recommendation.tradeoff import (
    examples_factor,
    steps_factor,
    steps_for_examples_factor,
    throughput_at,
)

__all__ = [
    "AdaptDecision",
    "AdaptPolicy",
    "OBJECTIVES",
    "ObjectivePlan",
    "OperatingPoint",
    "ProbeSummary",
    "ProbeView",
    "Ratio",
    "Recommendation",
    "STATUSES",
    "assess",
    "candidates",
    "examples_factor",
    "lr_rule_for",
    "optimizer_name",
    "probe_inputs",
    "recommend",
    "scale_lr",
    "split",
    "steps_factor",
    "steps_for_examples_factor",
    "throughput_at",
    "warmup_epochs_for",
    "warmup_lambda",
    "warmup_lr",
]
