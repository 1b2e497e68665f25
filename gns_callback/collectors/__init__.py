"""Where small-batch gradient norms come from: one module per method, chosen here and nowhere else.

Every collector has the same small interface (:class:`Collector`): ``attach``/``detach`` its hooks,
``measured_parameters``, ``coverage``, ``enabled`` (hooks inert while False), ``discard``, ``expect_batch_size`` (the
next micro-batch's size, before its forward pass), ``call_at_pass_end`` (a callback as each backward pass that fills
``.grad`` ends), and ``pop_into(window, ...)``,
which adds the committed backward passes since the last call to an
:class:`~gns_callback.accumulation.AccumulationWindow`, each scaled by the collector's own rule. A third method
is one new module plus one entry in :data:`COLLECTORS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

from torch import nn

from gns_callback.accumulation import AccumulationWindow, LossReduction
from gns_callback.collectors.coverage import Coverage
from gns_callback.collectors.micro_batch import MicroBatchCollector
from gns_callback.collectors.per_example import PerExampleCollector
from gns_callback.per_example.compiled import problem as compiled_problem
from gns_callback.per_example.tracker import MICRO_BATCH_HINT, MIN_COVERAGE, supported_layer_names

METHODS = ("auto", "micro_batch", "per_example")



class Collector(Protocol):
    method: str
    needs_batch_sizes: bool
    enabled: bool

    def attach(self) -> None: ...

    def detach(self) -> None: ...

    def discard(self) -> None: ...

    def expect_batch_size(self, size: Optional[int]) -> None: ...

    def call_at_pass_end(self, callback: Optional[Callable[[], None]]) -> None: ...

    def measured_parameters(self) -> list[nn.Parameter]: ...

    def left_out_parameters(self) -> list[nn.Parameter]: ...

    def coverage(self) -> Coverage: ...

    def pop_into(
        self,
        window: AccumulationWindow,
        *,
        batch_sizes: Optional[Sequence[int]],
        loss_divisor: Optional[float],
        loss_reduction: LossReduction,
    ) -> int: ...


COLLECTORS: dict[str, Callable[..., Collector]] = {
    "micro_batch": lambda model, max_examples=None: MicroBatchCollector(model),
    "per_example": lambda model, max_examples=None: PerExampleCollector(model, max_examples=max_examples),
}


BATCH_NORM_COUPLES = ("the model has BatchNorm in training mode, which couples the examples of a batch, so per-example "
                      "gradients are not independent samples")


#: Why ``micro_batch`` can't read data-parallel ranks normalised by ``SyncBatchNorm`` in training mode, and the fix.
SYNCED_BATCH_NORM_COUPLES = (
    "the model has SyncBatchNorm in training mode on several data-parallel ranks: each rank normalises with the "
    "global batch's statistics and its backward all-reduces their gradients, so a rank's gradient is its examples' "
    "share of the global one, coupled to every other rank's examples, not an independent micro-batch gradient "
    "(simulated on the digits BatchNorm CNN, micro_batch read 1.4–2.6× the noise scale of the step's gradient, its "
    "interval excluding it; benchmarks/synced_batch_norm.py). Train with per-device BatchNorm (Lightning: "
    "sync_batchnorm=False; plain BatchNorm under DDP is measured as it is), or normalise without batch statistics "
    "(GroupNorm, LayerNorm)"
)


def synced_batch_norms(model: nn.Module) -> tuple[nn.Module, ...]:
    """The model's ``SyncBatchNorm`` layers (they sync in training mode, or in eval mode without running
    statistics, once a process group of several ranks exists)."""
    return tuple(module for module in model.modules() if isinstance(module, nn.SyncBatchNorm))


def synced_batch_norm_problem(norms: Sequence[nn.Module], several_ranks: bool) -> Optional[str]:
    """:data:`SYNCED_BATCH_NORM_COUPLES` when the run has ``several_ranks`` (data-parallel) and one of ``norms``
    (:func:`synced_batch_norms`) normalises with batch statistics now, else None."""
    if several_ranks and any(m.training or not m.track_running_stats for m in norms):
        return SYNCED_BATCH_NORM_COUPLES
    return None


class UnmeasurableSetup(ValueError):
    """The model/run can't be measured with the requested method; the message says why and what works."""


@dataclass(frozen=True)
class MethodChoice:
    method: str
    note: Optional[str] = None  # why auto chose this method (info)
    fallback: Optional[str] = None  # the method to switch to if the hooks find ``method`` can't measure a step


def per_example_problem(model: nn.Module, compiled: bool = False,
                        batch_norm: bool = True) -> tuple[Optional[str], float, float]:
    """Why per-example norms are invalid for ``model`` (or None), the share of parameters they'd cover, and the
    share of bare parameters they may cover from the first step on (:mod:`~gns_callback.per_example.broadcast`).
    ``compiled``: the caller knows ``model``'s forward runs under ``torch.compile``
    (:mod:`~gns_callback.per_example.compiled`). ``batch_norm``: whether BatchNorm's mode now is that of the
    training steps (False: not yet known, and not judged)."""
    collector = PerExampleCollector(model)
    coverage, bare = collector.coverage(), collector.tracker.bare_parameter_fraction()
    compile_problem = compiled_problem(model, compiled)
    if compile_problem is not None:
        return compile_problem, coverage.fraction, bare
    if coverage.measured_parameters == 0 and bare == 0:
        return _nothing_measurable(collector.tracker.excluded_reasons), 0.0, bare
    if batch_norm and collector.tracker.has_batchnorm_in_training():
        return BATCH_NORM_COUPLES, coverage.fraction, bare
    return None, coverage.fraction, bare


def _nothing_measurable(excluded: dict[str, str]) -> str:
    """Why no parameter can be measured per example: each one's reason (the first three), and what can be."""
    reasons = "; ".join(f"'{name}': {why}" for name, why in list(excluded.items())[:3])
    more = f" and {len(excluded) - 3} more" if len(excluded) > 3 else ""
    return (f"no trainable parameter can be measured per example ({reasons or 'the model has none'}{more}); the "
            f"layers measured are {supported_layer_names()}, and parameters of a module's own broadcast over the "
            "batch or multiplying it (x @ W)")


def choose_method(requested: str, model: nn.Module, *, several_micro_batches: bool, compiled: bool = False,
                  batch_norm: bool = True) -> MethodChoice:
    """The method to measure ``model`` with; raises :class:`UnmeasurableSetup` with the reason and the fix.

    ``several_micro_batches``: the run has more than one backward pass per optimizer step (gradient
    accumulation and/or several data-parallel ranks), which ``micro_batch`` needs. ``compiled``: ``model``'s forward
    runs under ``torch.compile`` in a way its modules don't show (a framework compiled it whole). ``batch_norm``:
    whether BatchNorm's mode now is that of the steps (see :func:`per_example_problem`).
    """
    if requested not in METHODS:
        raise ValueError(f"method={requested!r}: use one of {', '.join(METHODS)}.")
    if requested == "micro_batch":
        if not several_micro_batches:
            raise UnmeasurableSetup(_NEEDS_MICRO_BATCHES.format(who="method='micro_batch'"))
        return MethodChoice("micro_batch")
    problem, fraction, _ = per_example_problem(model, compiled, batch_norm)
    if requested == "per_example":
        if problem is not None:
            raise UnmeasurableSetup(f"method='per_example': {problem}; use method='micro_batch'.")
        return MethodChoice("per_example")  # the meter says what it covers (:func:`coverage_warning`)
    return _choose_auto(problem, fraction, several_micro_batches)


def _choose_auto(problem: Optional[str], fraction: float, several_micro_batches: bool) -> MethodChoice:
    """per_example where it is valid and covers the model (then micro_batch as the fallback if the run allows it:
    the hooks may still find mid-run what no inspection of the model shows), else micro_batch where possible. Bare
    parameters are not counted on: whether they can be read shows only at the first step."""
    if problem is None and fraction >= MIN_COVERAGE:
        return MethodChoice("per_example", fallback="micro_batch" if several_micro_batches else None)
    if several_micro_batches:
        why = problem or f"per-example norms would cover only {fraction:.1%} of the trainable parameters"
        return MethodChoice("micro_batch", note=f"method='auto' uses 'micro_batch' ({why}).")
    if problem is None:
        return MethodChoice("per_example")  # the covered share: the meter says so (:func:`coverage_warning`)
    raise UnmeasurableSetup(
        f"method='auto' found no valid estimator: per-example norms are not usable ({problem}) and "
        + _NEEDS_MICRO_BATCHES.format(who="method='micro_batch'")
    )


NO_TRAINABLE = (
    "the model has no trainable parameters (none with requires_grad=True), so nothing is measured: pass the module "
    "being trained (the one whose parameters the optimizer holds), or unfreeze its parameters (the meter takes up "
    "trainable parameters that appear within 50 steps)"
)


def coverage_warning(collector: Collector) -> Optional[str]:
    """What the user must hear about ``collector``'s share of the trainable parameters (None: it covers
    :data:`MIN_COVERAGE` of them): below it, B_simple is that of the covered parameters alone; above it with bare
    parameters counted, whether those are read shows at the first step."""
    tracker = getattr(collector, "tracker", None)
    coverage = collector.coverage()
    if coverage.trainable_parameters == 0:
        return NO_TRAINABLE
    fraction = coverage.fraction
    if tracker is None or fraction >= MIN_COVERAGE:
        return None
    bare = tracker.bare_parameter_fraction()
    if fraction + bare >= MIN_COVERAGE:
        return (
            f"per-example norms cover {fraction:.1%} of the trainable parameters at fit start; {bare:.1%} more are "
            "bare parameters (a class token, a position table, a layer scale, a weight applied as x @ W), measured "
            "from the first step on where each example's gradient can be read at the op that broadcasts them over "
            "the batch or multiplies the examples by them. The report's "
            "'coverage' says what was measured, and a warning says so if they are left out."
        )
    return (
        f"per-example norms cover only {fraction:.1%} of the trainable parameters (layers of other types are "
        "left out, see 'coverage'): B_simple is that of the covered parameters. For the whole model, "
        f"{MICRO_BATCH_HINT}."
    )


_NEEDS_MICRO_BATCHES = (
    "{who} compares each micro-batch's gradient with the step's gradient, so it needs several micro-batches "
    "per optimizer step: set accumulate_grad_batches=2 or more, or train on 2+ devices."
)

__all__ = [
    "COLLECTORS",
    "METHODS",
    "MIN_COVERAGE",
    "Collector",
    "Coverage",
    "MethodChoice",
    "MicroBatchCollector",
    "PerExampleCollector",
    "UnmeasurableSetup",
    "choose_method",
    "coverage_warning",
    "per_example_problem",
    "synced_batch_norm_problem",
    "synced_batch_norms",
]
