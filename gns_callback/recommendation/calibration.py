"""Is the critical batch calibrated for this optimizer? Which way may the batch move on it?

The critical batch read off the noise scale (:mod:`gns_callback.critical_batch`) was calibrated against
McCandlish et al.'s slow measurement (LR tuned per batch, steps to a target, ``S = S_min(1 + B_crit/B)``) for
plain SGD: within ×2 in 82 of 84 digits runs (11 of 21 on breast cancer, held out from that choice; its interval held
the slow-way value in 19 of 21 there). For other optimizers it reads low, measured on digits
(``benchmarks/critical_batch_summary.py``, ``benchmarks/payoff.py``):

* SGD with momentum 0.9 (MLP): slow-way ``B_crit`` 476, the reading 0.06–0.23× of it;
* Adam: MLP ``B_crit`` 335, readings 51–178 from runs at batch 8, 32 and 512; CNN 254, readings 53–70;
* SGD with Nesterov momentum 0.9 (MLP): ``B_crit`` 256, readings 42–55; AdamW (weight decay 0.01): 368, readings
  42–135.
* SGD with momentum 0.9 on a CNN with BatchNorm in training mode (``micro_batch``, ``accumulate_grad_batches=2``;
  per-example norms are refused there): ``B_crit`` 182, readings 0.11–0.81× of it.

A CNN with BatchNorm in training mode, plain SGD, read the same way: slow-way ``B_crit`` 59.6, readings 0.53–3.1× of
it, within ×2 in 34 of 35 runs, the trust range holding it in 35 of 35 (``benchmarks/batch_norm_callback.py``).

RMSprop and Adagrad (no first moment) read high instead: digits MLP ``B_crit`` 41 and 34, readings 42–57 and 36–86;
breast cancer (RMSprop) 78, readings 393–396. The policy below is kept for them too: a move up goes to the
interval's near end. Optimizers not listed in :data:`MEASURED` are taken as a lower bound, and the reason says they
were not measured.

The gradient noise cannot see the optimizer: momentum and Adam take larger useful steps at large batch, which
lowers ``S_min`` and raises ``B_crit = E_min/S_min``. So for them the reading is a lower bound, not an estimate:
a move *up* to it is still below the knee (fewer steps, few extra examples), while a move *down* to it could
cost several times the steps. For those optimizers the recommendation only raises the batch. A plain SGD
optimizer whose momentum is unknown (a class or a name, not an instance) is taken as plain SGD.
"""

from __future__ import annotations

from typing import Optional

from gns_callback.recommendation.rules import NOISE_LINEAR, OptimizerLike, lr_rule_for, optimizer_name
from gns_callback.recommendation.stability import momentum_of


#: What the report says for plain SGD, the calibrated case.
CALIBRATED = ("plain SGD: the calibrated case (within ×2 of the slow-way B_crit in 82 of 84 digits runs; on "
              "breast cancer, held out, in 11 of 21, its interval holding B_crit in 19 of 21; on a digits CNN with "
              "BatchNorm, measured with micro_batch, in 34 of 35; benchmarks/RESULTS.md)")


#: The slow-way B_crit over the noise-scale reading on the digits MLP (and CNN for Adam), lowest and highest over the
#: runs, by optimizer: the cases measured (``benchmarks/payoff.py``, ``benchmarks/critical_batch_summary.py``;
#: benchmarks/RESULTS.md). Below 1 the reading overstates B_crit.
MEASURED = {
    "momentum 0.9": (1.2, 17.0),  # digits MLP 4.0–17; the BatchNorm CNN 1.2–9.1
    "Nesterov momentum 0.9": (4.6, 6.0),
    "Adam": (1.9, 6.6),
    "AdamW": (2.7, 8.7),
    "RMSprop": (0.73, 0.99),
    "Adagrad": (0.39, 0.94),
}
_MEASURED_RANGE = "1.9–17×"  # momentum 0.9 and Adam together


def optimizer_label(optimizer: OptimizerLike) -> Optional[str]:
    """How :data:`MEASURED` names ``optimizer``: ``"momentum 0.9"`` or ``"Nesterov momentum 0.9"`` for an SGD-family
    instance with momentum, ``None`` for plain SGD (the calibrated case: an SGD-family optimizer without momentum, or
    whose momentum is unknown), else its class name (``"an unknown optimizer"`` for ``None``)."""
    rule, _ = lr_rule_for(optimizer)
    momentum = momentum_of(optimizer)
    if rule == NOISE_LINEAR:
        if momentum is None or momentum.beta == 0.0:
            return None
        return f"{'Nesterov momentum' if momentum.nesterov else 'momentum'} {momentum.beta:g}"
    return optimizer_name(optimizer) if optimizer is not None else "an unknown optimizer"


def uncalibrated_reason(optimizer: OptimizerLike) -> Optional[str]:
    """``None`` for plain SGD (the calibrated case); otherwise why the critical batch only bounds ``B_crit``
    from below for ``optimizer``: the measured ratio from :data:`MEASURED`, or that it was not measured."""
    what = optimizer_label(optimizer)
    if what is None:
        return None
    if what not in MEASURED:
        return (f"the critical batch is calibrated for plain SGD; {what} was not measured (with momentum 0.9 and Adam "
                f"the slow-way B_crit on digits was {_MEASURED_RANGE} the noise-scale reading), so the reading is "
                "taken as a lower bound")
    low, high = MEASURED[what]
    measured = (f"the critical batch is calibrated for plain SGD; with {what} the slow-way B_crit on digits was "
                f"{low:g}–{high:g}× the noise-scale reading")
    if low >= 1.0:
        return measured + ", which is then a lower bound"
    return measured + (", which may overstate it (not a lower bound; 0.2× on breast cancer for RMSprop); the batch "
                       "is still only raised, to the near end of the interval")


def may_move(target: float, current_batch_size: int, optimizer: OptimizerLike) -> Optional[str]:
    """``None`` when the batch may move from ``current_batch_size`` to ``target``; otherwise the reason it may not
    (a decrease on an optimizer the critical batch is not calibrated for)."""
    reason = uncalibrated_reason(optimizer)
    if reason is None or target >= current_batch_size:
        return None
    return (f"{reason}: keeping the current batch {current_batch_size} rather than lowering it to {target:.4g} "
            "(a decrease could cost several times the steps)")
