"""Two checks, on the first batch, that per-example norms measure what they claim for this model and loss.

Per-example norms read example ``i``'s gradient as what flows through its own rows of every measured layer, and
``|G_B|²`` off the parameters' whole gradient. Both must hold:

1. **Each parameter's gradient is the sum of its layers' per-example gradients.** Something else adding to it
   reaches ``|G_B|²`` but no example's norm: a penalty on the parameter itself in the loss (an explicit L2 term), the
   parameter used outside its layer (``h @ embedding.weight.T``), a gradient hook on it. ``tr Σ`` and ``|G|²`` are
   then both off, by a term the interval knows nothing of. The first pass recomputes each measured layer's weight
   gradient from its inputs and output gradients, every example at once, and compares it with the parameter's
   gradient: float32 rounding differs by about 1e-7 of the norm, a 1e-4 L2 penalty on a digits MLP by 1.6%.
2. **The examples reach the loss independently.** That makes ``i``'s rows carry the gradient of its own loss term,
   when the loss is a sum of per-example terms or any function of such a sum (a mean, a mean over tokens, an RMSE):
   the terms then differ only by one factor common to the batch. A loss that couples the examples (the in-batch
   negatives of a contrastive loss, a statistic over the batch in the loss or between layers, in-batch mining) makes
   each row's gradient depend on the other examples, and the interval is as narrow as ever: on a digits MLP with an
   in-batch contrastive loss the meter read B_simple = 6.9 [6.8, 6.9], while no per-example gradient exists to
   compare it with. The batch's forward and backward run twice from the same state; the second time the first half's
   rows are copied over the second half's: in the batch itself where the caller can run the step on such a batch
   (the Lightning callback does), else at the first measured layer whose input holds the batch. Where that reads
   independent, a third time with every row of the second half copied from the first row: the first copy leaves a
   statistic of the batch as it was wherever the halves agree on it (``pos_weight`` = the batch's negatives over its
   positives, with as many positives in each half: 20 of 100 first batches of breast cancer read independent, and
   a fit on one read B_simple = 4.61 [4.43, 4.80] against 5.56 for its batch gradient; ``python
   benchmarks/loss_survey.py``), the second moves it unless the batch is of one class. Independent examples keep
   the first half's per-example norms; a spread of more than ``tolerance`` (0.1%) among the ratios says they are
   coupled. A common factor other than 1 (beyond ``tolerance``) says the loss is scaled by something computed from
   the batch: a count that moves with the examples (``(l * mask).sum() / mask.sum()`` over padded tokens), the
   square root of a mean (an RMSE), a statistic of the batch's targets. The batch gradient is then a ratio of sums,
   whose noise changes with the batch size, and it is refused too (``"scaled by the batch"``): an RMSE on a
   diabetes MLP read 9.4–9.6 (95% CIs ±3.5%) where its batch gradient's noise at 32 is 8.6
   (``benchmarks/batch_normalised_losses.py``). Two passes of the same computation give the same rows to the bit
   (the same shapes, kernels and random draws; 1.5e-7 where a common factor such as RMSE's is recomputed), so the
   tolerance only needs to exceed rounding. An in-batch contrastive loss spreads them by 16%, BatchNorm in training
   mode by 19%, logits centred on the batch mean by 0.33% (a digits MLP, batch 32;
   ``benchmarks/per_example_checks.py``). Mixing the batch's examples before the model (mixup in ``training_step``:
   each row a blend of two examples of the batch, with one weight for the batch) couples them too: the rows share
   examples and the weight, so the batch gradient varies more than rows drawn apart would. On the digits MLP at fixed
   parameters the meter read B_simple = 49.5 [45.0, 54.9] with mixup (α = 0.4, batch 32), where the mixup batch
   gradient's own noise, by brute force over 40,000 batches, gives 92.6; copying rows in the batch catches it.
   Mixing done in the data loader (a collate function) happens before any check can copy rows, and is not seen.

The first pass also watches the loss's arguments (:mod:`.weighted_mean`): a mean over the batch's own class weights
(``cross_entropy(..., weight=w)``), or over the targets not ignored where examples keep unequal numbers of them
(padding with ``ignore_index``), divides by a sum that moves with the examples, which no method measures.

Torch only, no Lightning.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from gns_callback.batch_size import first_half_rows
from gns_callback.own_hooks import OwnHook

from .layout import LayoutError, batch_dim, is_sequence_first, position_dims
from .sketch import restart_probes
from .sum_check import Rest, SumCheck
from .param_path import is_parameter
from .tracker import (MICRO_BATCH_HINT, MISREAD_BATCH_SIZE, SUPPORTED_MODULES, PerExampleNormTracker,
                      misread_batch_reason)
from .transposed_linear import layer_kind
from .weighted_mean import WeightedMeanWatch, weighted_mean_reason

__all__ = ["PerExampleCheck", "check_loss_divisor", "check_per_example", "first_step_check"]

#: Largest relative difference read as rounding: of a parameter's gradient from its layers' summed per-example
#: gradients, and of one example's norm ratio from the median ratio (``max_i |r_i / median(r) − 1|``).
TOLERANCE = 1e-3
#: Examples compared (the first ones; fewer where the batch's first half is smaller).
EXAMPLES = 16
#: The hooks can't measure this model on a batch of the stated size (its layers' rows are not its examples, say).
UNMEASURABLE = "unmeasurable"
#: The loss's mean divides by a sum that moves with the batch (class weights, targets not ignored;
#: :mod:`.weighted_mean`): no method measures it.
WEIGHTED_MEAN = "weighted mean"
#: The examples are independent, but the loss is scaled by a factor computed from the batch (a count or a statistic
#: of it, RMSE's square root): copying rows moved every norm of the first half by one factor.
BATCH_SCALED = "scaled by the batch"
#: A layer that declares its layout (``batch_first``) holds more examples than the batch's size read off its tensors
#: (a sequence-first batch, ``(T, B, ...)``, read as T examples): ``micro_batch`` would read its noise at that size.
SIZE_MISREAD = "batch size misread"
#: Outcomes that make per-example norms unusable for this model and loss.
REFUSED = ("extra gradient", "coupled", UNMEASURABLE, WEIGHTED_MEAN, BATCH_SCALED, SIZE_MISREAD)
#: Outcomes no other method measures either: a micro-batch's loss is scaled by its own batch the same way, or its
#: size is misread the same way.
NO_METHOD = (WEIGHTED_MEAN, BATCH_SCALED, SIZE_MISREAD)
#: ``micro_batch``'s check (:func:`check_loss_divisor`): the loss's divisor alone, which was constant.
DIVISOR_CHECKED = "divisor checked"
#: Check 1 alone passed, on a training step (:func:`first_step_check`); check 2 was not run.
SUMS_CHECKED = "sums checked"
#: Largest share of ``tr Σ`` a gradient part common to every example (a penalty on the parameters) may move.
IMPACT = 1e-2


@dataclass(frozen=True)
class PerExampleCheck:
    """The outcome: ``status`` is ``"independent"`` (both checks passed), ``"extra gradient"`` (check 1 failed),
    ``"coupled"`` (check 2 failed), ``"unmeasurable"`` (the hooks can't measure the batch's passes at all),
    ``"weighted mean"`` (the loss divides by the batch's sum of class weights, or its count of targets not ignored:
    no method measures it), ``"scaled by the batch"`` (check 2 passed but moved every norm by one factor: the loss
    is scaled by something computed from the batch, which no method measures either), ``"batch size misread"`` (a
    layer that declares its layout holds more examples than the batch's size read off its tensors: a sequence-first
    batch; ``micro_batch`` would read the same wrong size),
    ``"sums checked"`` (check 1 alone passed, on a training step), ``"divisor checked"`` (``micro_batch``'s check of
    the loss's divisor alone passed) or ``"not checked"``; ``spread`` the largest
    relative difference the failed or last check read (NaN when not checked); ``detail`` says why: the reason to stop
    measuring, why nothing was checked, or for a pass a note (a penalty on the parameters measured as is, and what
    it moves)."""

    status: str
    spread: float = float("nan")
    detail: str = ""

    @property
    def refused(self) -> bool:
        """Per-example norms would measure something else here."""
        return self.status in REFUSED

    def to_dict(self) -> dict[str, Any]:
        """For the JSON report (NaN as None)."""
        return {"status": self.status, "spread": self.spread if math.isfinite(self.spread) else None,
                "detail": self.detail}


def check_per_example(model: nn.Module, run_pass: Callable[[], None], batch_size: int, reset: Callable[[], None],
                      tolerance: float = TOLERANCE,
                      run_replaced_pass: Optional[Callable[[], None]] = None,
                      run_first_row_pass: Optional[Callable[[], None]] = None) -> PerExampleCheck:
    """Run ``run_pass`` (one forward and backward of the same batch of ``batch_size`` examples) two or three times:
    the first time comparing each parameter's gradient with its layers' summed per-example gradients, then with rows
    replaced, to compare the first half's per-example norms (module docstring): the second half's rows copied from
    the first half's, and where that reads independent, a third time, each copied from the first row (a statistic
    of the batch, such as ``pos_weight`` = its negatives over its positives, that the first copy left as it was
    moves with the second: :func:`gns_callback.batch_size.first_half_rows`).

    ``run_replaced_pass`` and ``run_first_row_pass``, where the caller has the batch: the same pass on the batch
    with its second half's rows copied from the first half's, and from its first row
    (:func:`gns_callback.batch_size.first_half_copied`), so that examples mixed before the model (mixup) and
    statistics of the labels are seen too. Without them the rows are copied at the first measured layer's input.

    ``reset()`` runs between the passes and must put back everything the first one changed that the second would
    read: the random states (so both draw the same dropout masks), and buffers and attributes a step updates (a
    queue of negatives, a momentum encoder), as ``ProbeState.restore`` does. The passes leave ``.grad`` set to the
    second one's gradients (fresh tensors: the caller's are left untouched); the caller puts back the rest."""
    half = batch_size // 2
    if half < 2:
        return PerExampleCheck("not checked", detail=f"a batch of {batch_size} has no two examples to compare")
    tracker = PerExampleNormTracker(model, max_examples=min(EXAMPLES, half))
    tracker.expected_batch_size = batch_size
    tracker.runs_when_paused = True  # the meters are paused for these passes, this tracker is the check's own
    try:
        with tracker, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # what this tracker finds, the meter's says at its first step
            tracker.sum_check = first = SumCheck()
            with WeightedMeanWatch(batch_size) as watch:
                before = _norms(model, tracker, run_pass)
            if watch.found is not None:
                return PerExampleCheck(WEIGHTED_MEAN, detail=weighted_mean_reason(watch.found, watch.divides_by))
            tracker.sum_check = second = SumCheck()
            reset()
            after, replaced = _replaced_norms(model, tracker, batch_size, run_pass, run_replaced_pass)
            halves, from_row = _compare(before, after, half, tolerance), None
            if replaced and halves.status == "independent":
                tracker.sum_check = None
                reset()
                from_row, _ = _replaced_norms(model, tracker, batch_size, run_pass, run_first_row_pass, True)
    except RuntimeError as error:  # the hooks can't measure this model on such a batch: its steps would read wrong
        return PerExampleCheck(SIZE_MISREAD if MISREAD_BATCH_SIZE in str(error) else UNMEASURABLE, detail=str(error))
    finally:
        restart_probes()
    extra, note = _extra_gradient(first, second, batch_size, tolerance)
    if extra is not None:
        return extra
    if not replaced:
        return PerExampleCheck("not checked", detail="no measured layer's input holds the batch")
    result = _either_copy(halves, _compare(before, from_row, half, tolerance))
    return replace(result, detail=note) if note and not result.refused else result


def check_loss_divisor(run_pass: Callable[[], None], batch_size: int,
                       model: Optional[nn.Module] = None) -> PerExampleCheck:
    """``micro_batch``'s check, on one pass of the batch: whether the loss's mean divides by a sum that moves with
    the batch (:mod:`.weighted_mean`). A micro-batch's loss is then a ratio of its own, whose noise is that at the
    micro-batch's size, not the run's (class weights 0.1–10 on the digits: 15.2–16.2 at micro-batches of 8, where
    the batch of 32 has 11.1; ``benchmarks/batch_normalised_losses.py``). A divisor the loss watch can't see (a mask
    over its own sum, an RMSE) is not found: that takes the per-example norms of :func:`check_per_example`.

    With ``model``, also whether a sequence-first layer of it (``nn.LSTM``/``GRU``/``RNN``, ``nn.MultiheadAttention``
    with ``batch_first=False``) holds more examples in dim 1 than ``batch_size``, the size read off the batch: a
    ``(T, B, ...)`` batch read as T examples (:data:`SIZE_MISREAD`). ``micro_batch`` reads ``B_simple`` in units of
    that size, ``T/B`` times the exact value (``tests/trust/test_sequence_first.py``)."""
    with WeightedMeanWatch(batch_size) as watch, _sequence_first_sizes(model) as held:
        run_pass()
    if watch.found is not None:
        return PerExampleCheck(WEIGHTED_MEAN, detail=weighted_mean_reason(watch.found, watch.divides_by))
    more = [(name, kind, size) for name, kind, size in held if size > batch_size]
    if more:
        name, kind, size = more[0]
        reason = misread_batch_reason(f"with batch_first=False the input (L, N, E) of module '{name}' ({kind}) "
                                      f"holds {size} examples, but the batch has {batch_size}")
        return PerExampleCheck(SIZE_MISREAD, detail=f"{reason}.")
    return PerExampleCheck(DIVISOR_CHECKED)


@contextmanager
def _sequence_first_sizes(model: Optional[nn.Module]) -> Iterator[list[tuple[str, str, int]]]:
    """``(name, kind, examples)`` of each call of a sequence-first recurrent or attention module of ``model`` while
    the context is open: dim 1 of its batched 3-D input (query)."""
    held: list[tuple[str, str, int]] = []

    def pre_hook(name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inp = args[0] if args else kwargs.get("input", kwargs.get("query"))
        if isinstance(inp, Tensor) and inp.dim() == 3:
            held.append((name, type(module).__name__, int(inp.shape[1])))

    modules = [] if model is None else [(name, module) for name, module in model.named_modules()
                                        if getattr(module, "batch_first", None) is False
                                        and isinstance(module, (nn.RNNBase, nn.MultiheadAttention))]
    handles = [module.register_forward_pre_hook(OwnHook(partial(pre_hook, name)), with_kwargs=True)
               for name, module in modules]
    try:
        yield held
    finally:
        for handle in handles:
            handle.remove()


def _either_copy(halves: PerExampleCheck, first_row: PerExampleCheck) -> PerExampleCheck:
    """The outcome of the two copies (the second half's rows from the first half's, and from its first row): the
    first that refuses (coupled, or scaled by the batch), else independent with the larger spread (a copy not run or
    not read leaves the other one's)."""
    if halves.status != "independent":
        return halves
    if first_row.refused:
        return first_row
    if first_row.status != "independent":
        return halves
    return halves if halves.spread >= first_row.spread else first_row


def first_step_check(sum_check: SumCheck, batch_size: Optional[int]) -> Optional[PerExampleCheck]:
    """Check 1 on one training step's passes alone (the meter's own, where :func:`check_per_example` was not run):
    ``"sums checked"``, or ``"extra gradient"``; None where the step can't tell (nothing compared, or a gradient not
    finite, as on a step the GradScaler skips).

    One pass can't tell a rest that varies with the examples (``h @ embedding.weight.T``) from one that doesn't,
    except by its shape: a rest that is a multiple of its parameter (``|R − cθ|`` within rounding) is an L2 term,
    the same for every example, and is sized as :func:`check_per_example` sizes a penalty (over ``batch_size``
    examples, one pass: None where the step ran several); any other rest is refused, and the reason names that check
    as one way on."""
    rests = sum_check.rests
    if not rests or not all(rest.finite for rest in rests.values()):
        return None
    beyond = sum_check.beyond_rounding()
    if not beyond:
        return PerExampleCheck(SUMS_CHECKED, max(_rest_share(rest) for rest in rests.values()), _SUMS_NOTE)
    varying = [name for name, rest in beyond.items() if rest.off_parameter > max(rest.rounding, TOLERANCE * rest.norm)]
    if varying or batch_size is None:
        share, name = max((_rest_share(beyond[name]), name) for name in (varying or beyond))
        return PerExampleCheck("extra gradient", share, _one_pass_reason(name, share))
    impact = _trace_shift(sum_check, beyond, batch_size)
    if impact > IMPACT:
        return PerExampleCheck("extra gradient", impact, _fixed_reason(impact))
    return PerExampleCheck(SUMS_CHECKED, impact, f"{_SUMS_NOTE}; an L2 term in the loss reaches |G_B|² but no "
                                                 f"example's norm and moves tr Σ by {impact:.2%}, measured as is")


_SUMS_NOTE = ("each parameter's gradient is its layers' summed per-example gradients (on the first measured step); "
              "whether the examples are coupled was not checked: meter.check_per_example(...) checks that")


def _extra_gradient(first: SumCheck, second: SumCheck, batch_size: int,
                    tolerance: float) -> tuple[Optional[PerExampleCheck], str]:
    """Check 1: ``(refusal or None, note)`` from each parameter's ``(S, R, rounding)`` in the two passes.

    A rest ``R`` that changes with the examples (the second pass replaced half of them) is part of their gradients
    that no norm sees: refused. One that doesn't (a penalty on the parameters) is the same in every example's
    gradient; it moves the plug-in ``tr Σ = mean|g_i|² − |ḡ|²`` by ``−(2ḡ·R + |R|²)`` (:func:`_trace_shift`),
    refused above ``IMPACT`` of it, else noted."""
    extra = list(first.beyond_rounding())
    if not extra:
        return None, ""
    rests, seconds = first.extra_gradients, second.extra_gradients
    varying = [name for name in extra if name not in seconds
               or float((seconds[name][1] - rests[name][1]).norm()) > tolerance * first.rests[name].norm]
    if varying:
        share, name = max((_rest_share(first.rests[n]), n) for n in varying)
        return PerExampleCheck("extra gradient", share, _varying_reason(name, share)), ""
    impact = _trace_shift(first, extra, batch_size)
    if impact > IMPACT:
        return PerExampleCheck("extra gradient", impact, _fixed_reason(impact)), ""
    return None, (f"a part of the gradient the same for every example (a penalty on the parameters) reaches |G_B|² but "
                  f"no example's norm; it moves tr Σ by {impact:.2%}, measured as is")


def _trace_shift(sum_check: SumCheck, names: Iterable[str], batch_size: int) -> float:
    """``|2ḡ·R + |R|²| / tr Σ`` over the parameters ``names`` with a rest, ``ḡ = S``, and the plug-in
    ``tr Σ = mean|g_i|² − |ḡ|²`` over every compared parameter (``mean|g_i|² = B·Σ_i |ĝ_i|²``, the hooks' units)."""
    rests = sum_check.rests
    shift = sum(2 * rests[name].summed_dot_rest + rests[name].norm ** 2 for name in names)
    trace = batch_size * sum_check.summed_sq_norms - sum(rest.summed_sq for rest in rests.values())
    return abs(shift) / trace if trace > 0 else math.inf


def _rest_share(rest: Rest) -> float:
    """``|R| / |S + R|``: the rest's share of the parameter's gradient."""
    return rest.norm / max(rest.whole, 1e-30)


def _varying_reason(name: str, share: float) -> str:
    return (f"{share:.1%} of parameter '{name}''s gradient is not carried by its layers' per-example gradients and "
            "changes with the examples: the parameter is used outside its layer (e.g. h @ embedding.weight.T: tie it "
            "to an nn.Linear instead), or a gradient hook changes it. No example's norm sees that part, so the noise "
            f"scale read from them would be wrong. Instead, {MICRO_BATCH_HINT}")


def _fixed_reason(impact: float) -> str:
    return ("a part of the gradient the same for every example (a penalty on the parameters in the loss, e.g. an L2 "
            f"term: use the optimizer's weight_decay instead) reaches |G_B|² but no example's norm, and moves tr Σ by "
            f"{impact:.1%}, so the noise scale read from these norms would be wrong. Instead, {MICRO_BATCH_HINT}")


def _one_pass_reason(name: str, share: float) -> str:
    return (f"{share:.1%} of parameter '{name}''s gradient is not carried by its layers' per-example gradients (on "
            "the first measured step): the parameter is used outside its layer (e.g. h @ embedding.weight.T: tie it "
            "to an nn.Linear instead), a gradient hook changes it, or the loss holds a penalty on the parameters "
            "other than an L2 term in a step of one backward pass (use the optimizer's weight_decay instead). No "
            "example's norm sees that part, so the noise scale read from them would be wrong. A penalty that moves "
            "tr Σ by under 1% is measured as is if meter.check_per_example(lambda: loss_fn(model(x), y).backward(), "
            "batch_size=len(x)) runs before the first step (it tells a penalty from a part that varies with the "
            f"examples). Or {MICRO_BATCH_HINT}")


def _norms(model: nn.Module, tracker: PerExampleNormTracker, run_pass: Callable[[], None]) -> Optional[Tensor]:
    for param in model.parameters():
        param.grad = None  # the pass fills fresh tensors: the caller's are put back untouched
    restart_probes()  # sketched norms draw the same probes in both passes
    run_pass()
    return tracker.pop()


def _replaced_norms(model: nn.Module, tracker: PerExampleNormTracker, batch_size: int, run_pass: Callable[[], None],
                    run_replaced_pass: Optional[Callable[[], None]],
                    from_first_row: bool = False) -> tuple[Optional[Tensor], bool]:
    """A replaced pass's norms, its rows copied in the batch (``run_replaced_pass``) or else at the first measured
    layer (from the first half's rows, or ``from_first_row``); and whether any rows were."""
    if run_replaced_pass is not None:
        return _norms(model, tracker, run_replaced_pass), True
    with _rows_replaced(model, tracker, batch_size, from_first_row) as replaced:
        after = _norms(model, tracker, run_pass)
    return after, bool(replaced)


def _compare(before: Optional[Tensor], after: Optional[Tensor], half: int, tolerance: float) -> PerExampleCheck:
    """The spread of ``after / before`` over the first half's examples with a nonzero gradient."""
    if before is None or after is None:
        return PerExampleCheck("not checked", detail="no per-example norms were measured")
    count = min(half, before.shape[0], after.shape[0])
    first, second = before[:count].double().cpu(), after[:count].double().cpu()
    used = (first > first.max() * 1e-12) & torch.isfinite(first) & torch.isfinite(second)
    if int(used.sum()) < 2:
        return PerExampleCheck("not checked", detail="fewer than two examples with a nonzero gradient")
    ratios = second[used] / first[used]
    factor = float(ratios.median())
    spread = float((ratios / factor - 1).abs().max())
    if spread > tolerance:
        return PerExampleCheck("coupled", spread, _coupled_reason(spread))
    if abs(factor - 1) > tolerance:
        return PerExampleCheck(BATCH_SCALED, abs(factor - 1), _batch_scaled_reason(factor))
    return PerExampleCheck("independent", spread)


def _batch_scaled_reason(factor: float) -> str:
    return (f"the loss is scaled by a factor computed from the batch: copying the second half's rows from the first "
            f"half scaled each of the first half's per-example gradients by the same {factor:.4g} (a mean over a "
            "count that moves with the examples, such as (l * mask).sum() / mask.sum() over padded tokens or a loss "
            "divided by the batch's number of positives; the square root of a mean, as an RMSE; a loss divided by "
            "a statistic of the batch's targets; a pair or triplet loss on the batch's own rows, where the fix is "
            "to store each pair as one example). The batch gradient is then a ratio of sums over the batch, whose "
            "noise changes with the batch size, so no single noise scale describes it (an RMSE loss on a diabetes "
            "MLP read 9.4–9.6, 95% CIs ±3.5%, where its batch gradient's own noise is 8.6). To measure it, divide "
            "by a constant instead (the mean of that count per batch over the training set), or train on the mean "
            "itself (MSE rather than RMSE: the same direction)")


def _coupled_reason(spread: float) -> str:
    return (f"the examples of a batch are coupled: copying the second half's rows from the first half changed the "
            f"first half's per-example gradient norms by up to {100 * spread:.2g}% (mixing the examples of the batch, as "
            "mixup or CutMix do, a contrastive loss with in-batch negatives, a statistic over the batch in the loss "
            "or between layers, or in-batch mining does this; so does a layer fed a sequence-first (T, B, ...) "
            "tensor whose sequence length equals the batch size, which reads dim 0 as the batch: then use a batch "
            "size other than the sequence length). Per-example gradients are then not samples of one distribution, "
            f"and the noise scale read from them would be wrong. Instead, {MICRO_BATCH_HINT}: it compares the "
            "gradients of whole micro-batches, each with its own in-batch terms")


@contextmanager
def _rows_replaced(model: nn.Module, tracker: PerExampleNormTracker, batch_size: int,
                  from_first_row: bool = False) -> Iterator[list[bool]]:
    """Inside, the first call of a measured layer whose input holds the batch gets rows ``h..2h`` of that input
    replaced by rows ``0..h`` (``h = batch_size // 2``; ``from_first_row``: each by row 0); the yielded list holds
    True once that happened."""
    replaced: list[bool] = []
    sequence_first = is_sequence_first(model)

    def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[tuple]:
        inp = args[0] if args else kwargs.get("input")
        if replaced or not isinstance(inp, Tensor) or is_parameter(inp):
            return None
        dim = _batch_dim(module, inp, batch_size, sequence_first)
        if dim is None:
            return None
        replaced.append(True)
        changed = _second_half_from_first(inp, dim, batch_size, from_first_row)
        return ((changed, *args[1:]), kwargs) if args else (args, {**kwargs, "input": changed})

    handles = [module.register_forward_pre_hook(OwnHook(pre_hook), with_kwargs=True)
               for module in tracker.measured_modules()
               if layer_kind(module) in SUPPORTED_MODULES]
    try:
        yield replaced
    finally:
        for handle in handles:
            handle.remove()


def _batch_dim(module: nn.Module, inp: Tensor, batch_size: int, sequence_first: bool) -> Optional[int]:
    """The dim of ``inp`` holding the batch as the tracker reads it, or None where it can't be told."""
    try:
        dim = batch_dim(inp.shape, position_dims(module, inp), batch_size, sequence_first)
    except LayoutError:
        return None
    return dim if inp.dim() > dim and inp.shape[dim] == batch_size else None


def _second_half_from_first(inp: Tensor, dim: int, batch_size: int, from_first_row: bool = False) -> Tensor:
    with torch.no_grad():
        rows = inp.detach().index_select(dim, first_half_rows(batch_size, inp.device, from_first_row))
    if not inp.requires_grad:
        return rows
    # Keep the graph to the layers before (their per-example norms are part of the comparison): the input plus a
    # correction that carries no gradient.
    return inp + (rows - inp.detach())
