"""The per-example meter under the loss functions people train with, against exact values, at fixed parameters.

    python benchmarks/loss_survey.py [--seeds 5] [--steps 300] [--draws 4000] [--first-batches 100] [--only NAME ...]

Each case: a small MLP (inputs -> 32 -> tanh -> outputs, ``torch.manual_seed(0)``) on one of scikit-learn's bundled
data sets, batches of 32 drawn with replacement, the plain-loop ``GradientNoiseScaleMeter`` (``method="per_example"``)
with ``meter.check_per_example`` on the first batch, given the batch with its second half's rows copied from the first
(as the README recommends, and as the Lightning callback runs it). Two exact values, float64:

* "examples": ``B_simple`` of each example's own term (the loss with ``reduction="sum"`` on that one example), over
  the whole data set, one backward pass per example; n/a where the loss is built on several examples of the batch.
* "batch": ``B·tr Cov(G_B)/|E G_B|²`` of the batch gradient the training loss itself produces, by Monte Carlo over
  ``--draws`` batches (``|E G_B|²`` corrected by ``tr Cov/draws``). It equals "examples" when the loss is a mean of
  independent per-example terms over a constant.

"held" counts the seeds whose 95% interval holds each exact value (the batch's by Monte Carlo, to about 1%);
"check" is what ``check_per_example`` said on each seed's first batch, with its rows copied in the batch
(``run_replaced_pass`` and ``run_first_row_pass``, as the Lightning callback runs it), and with them copied at the
model's first layer (the README's shortest call, which leaves the labels as they are). A refused setup has no
reading; the readings shown are then the norms' own, without the check (what a loop without
``meter.check_per_example`` would report). A second table checks ``--first-batches`` first batches of the losses
built on several examples of the batch, with the copy of the halves alone (before) and with the copy from the first
row after it (now).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.batch_size import first_half_copied  # noqa: E402

BATCH = 32
CLASS_WEIGHTS = torch.tensor([0.1, 0.2, 0.3, 0.5, 1.0, 1.0, 2.0, 3.0, 5.0, 10.0])
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor, str], torch.Tensor]


@dataclass
class Case:
    name: str
    data: str
    outputs: int
    loss: Loss  # (model, x, y, reduction): the training loss at "mean" (its own reduction), one term at "sum"
    per_example: bool = True  # whether one example's term is defined (False: built on pairs of the batch)


def standardised(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(0)) / x.std(0).clamp_min(1e-6)


def load(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) of a bundled data set, y as the cases read it."""
    from sklearn import datasets
    if name in ("digits", "digits_onehot", "digits_counts", "digits_bits", "digits_pairs", "digits_triplets"):
        data = datasets.load_digits()
        x, y = torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)
        if name == "digits_onehot":
            return x, F.one_hot(y, 10).float()
        if name == "digits_counts":
            return x, (x > 0.5).sum(1, keepdim=True).float()
        if name == "digits_bits":
            return x, ((y[:, None] >> torch.arange(4)) & 1).float()
        if name in ("digits_pairs", "digits_triplets"):
            return _with_partners(x, y, name == "digits_triplets")
        return x, y
    if name == "cancer":
        data = datasets.load_breast_cancer()
        return standardised(torch.tensor(data.data, dtype=torch.float32)), torch.tensor(data.target).float()[:, None]
    if name == "diabetes":
        data = datasets.load_diabetes()
        target = torch.tensor(data.target, dtype=torch.float32)[:, None]
        return standardised(torch.tensor(data.data, dtype=torch.float32)), (target - target.mean()) / target.std()
    raise ValueError(name)


def _with_partners(x: torch.Tensor, y: torch.Tensor, negative: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example stacked with a fixed positive of its class (and a fixed negative of another class): (N, k, 64)."""
    generator = torch.Generator().manual_seed(0)
    parts = [x]
    positive = torch.empty(len(y), dtype=torch.long)
    other = torch.empty(len(y), dtype=torch.long)
    for i in range(len(y)):
        same = (y == y[i]).nonzero().flatten()
        diff = (y != y[i]).nonzero().flatten()
        positive[i] = same[torch.randint(len(same), (1,), generator=generator)]
        other[i] = diff[torch.randint(len(diff), (1,), generator=generator)]
    parts.append(x[positive])
    if negative:
        parts.append(x[other])
    return torch.stack(parts, 1), y


def mlp(inputs: int, outputs: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(inputs, 32), nn.Tanh(), nn.Linear(32, outputs))


# ---------------------------------------------------------------------------------------------------- the losses
def _ce(weight: Optional[torch.Tensor] = None, **kw):
    def loss(m, x, y, r):
        out = m(x)
        return F.cross_entropy(out, y, weight=None if weight is None else weight.to(out.dtype), reduction=r, **kw)
    return loss


def _weights(y: torch.Tensor) -> torch.Tensor:
    return 1.0 + 2.0 * y  # a sample weight carried by the example: 3 on the positive class


def _bce_weight(m, x, y, r):
    return F.binary_cross_entropy_with_logits(m(x), y, weight=_weights(y), reduction=r)


def _bce_prob_weight(m, x, y, r):
    return F.binary_cross_entropy(torch.sigmoid(m(x)), y, weight=_weights(y), reduction=r)


def _bce_pos_weight(m, x, y, r):
    out = m(x)
    return F.binary_cross_entropy_with_logits(out, y, pos_weight=torch.tensor([3.0], dtype=out.dtype), reduction=r)


def _regression(fn):
    return lambda m, x, y, r: fn(m(x), y, reduction=r)


def _kl(reduction_of_mean: str):
    def loss(m, x, y, r):
        target = 0.9 * y + 0.01  # smoothed one-hot probabilities
        return F.kl_div(m(x).log_softmax(1), target, reduction=reduction_of_mean if r == "mean" else "sum")
    return loss


def _poisson(m, x, y, r):
    return F.poisson_nll_loss(m(x), y, log_input=True, reduction=r)


def _gaussian(m, x, y, r):
    out = m(x)
    return F.gaussian_nll_loss(out[:, :1], y, out[:, 1:].exp(), reduction=r)


def _multilabel(m, x, y, r):
    out = m(x)
    return F.multilabel_soft_margin_loss(out, y, weight=torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=out.dtype),
                                         reduction=r)


def _multi_margin(m, x, y, r):
    out = m(x)
    return F.multi_margin_loss(out, y, weight=CLASS_WEIGHTS.to(out.dtype), reduction=r)


def _none_mean(m, x, y, r):
    per = F.cross_entropy(m(x), y, reduction="none")
    return per.mean() if r == "mean" else per.sum()


def _none_sum_const(m, x, y, r):
    per = F.cross_entropy(m(x), y, reduction="none")
    return per.sum() / 50.0 if r == "mean" else per.sum()


def _ctc(m, x, y, r):
    """Digits as 8 rows of 8 pixels; targets of 1 or 2 labels (odd digits get a second one)."""
    steps = m(x.reshape(len(x), 8, 8)).log_softmax(-1).transpose(0, 1)  # (T, B, 11)
    second = (y + 3) % 10 + 1
    targets = torch.stack([y + 1, second], 1)
    lengths = 1 + (y % 2)
    per = F.ctc_loss(steps, targets, torch.full((len(x),), 8, dtype=torch.long), lengths, reduction="none")
    return per.div(lengths).mean() if r == "mean" else per.div(lengths).sum()  # "mean": F.ctc_loss's own reduction


def _weighted_mean_by_hand(m, x, y, r):
    """A sample-weighted mean written out, ``Σ w_i l_i / Σ w_i``, the weights the class weights of the examples."""
    per = F.cross_entropy(m(x), y, reduction="none")
    w = CLASS_WEIGHTS.to(per.dtype)[y]
    return (w * per).sum() / w.sum() if r == "mean" else (w * per).sum()


def _batch_pos_weight(m, x, y, r):
    """``pos_weight`` = the batch's negatives over its positives, as class balancing per batch is often written."""
    positives = y.sum().clamp_min(1)
    out = m(x)
    return F.binary_cross_entropy_with_logits(out, y, pos_weight=((len(y) - positives) / positives).reshape(1),
                                              reduction=r)


def _ranking_pairs(m, x, y, r):
    """Pairs (i, i + B/2) of the batch, ranked by their targets."""
    s = m(x).squeeze(1)
    h = len(x) // 2
    return F.margin_ranking_loss(s[:h], s[h:2 * h], torch.sign(y[:h, 0] - y[h:2 * h, 0]), margin=0.1, reduction=r)


def _cosine_pairs(m, x, y, r):
    z = m(x)
    h = len(x) // 2
    same = torch.where(y[:h] == y[h:2 * h], 1.0, -1.0)
    return F.cosine_embedding_loss(z[:h], z[h:2 * h], same, margin=0.2, reduction=r)


def _cosine_own_pairs(m, x, y, r):
    """Each example a stored pair (its positive, or a fixed negative): a siamese encoder run twice."""
    z1, z2 = m(x[:, 0]), m(x[:, 1])
    return F.cosine_embedding_loss(z1, z2, torch.ones(len(x)), margin=0.2, reduction=r)


def _triplet_rolled(m, x, y, r):
    """Anchor and stored positive; negatives the next example's anchor (a roll of the batch)."""
    a, p = m(x[:, 0]), m(x[:, 1])
    return F.triplet_margin_loss(a, p, a.roll(1, 0), margin=1.0, reduction=r)


def _triplet_own(m, x, y, r):
    """Each example a stored triplet (anchor, positive, negative)."""
    return F.triplet_margin_loss(m(x[:, 0]), m(x[:, 1]), m(x[:, 2]), margin=1.0, reduction=r)


CASES = [
    Case("cross_entropy", "digits", 10, _ce()),
    Case("cross_entropy label_smoothing=0.1", "digits", 10, _ce(label_smoothing=0.1)),
    Case("cross_entropy label_smoothing=0.1 weight=0.1-10", "digits", 10,
         _ce(label_smoothing=0.1, weight=CLASS_WEIGHTS)),
    Case("cross_entropy reduction='none' .mean()", "digits", 10, _none_mean),
    Case("cross_entropy reduction='none' .sum()/50", "digits", 10, _none_sum_const),
    Case("cross_entropy(reduction='none'), Σ w[y] l / Σ w[y] by hand", "digits", 10, _weighted_mean_by_hand),
    Case("bce_with_logits weight=1+2y", "cancer", 1, _bce_weight),
    Case("binary_cross_entropy weight=1+2y", "cancer", 1, _bce_prob_weight),
    Case("bce_with_logits pos_weight=3", "cancer", 1, _bce_pos_weight),
    Case("bce_with_logits pos_weight=negatives/positives of the batch", "cancer", 1, _batch_pos_weight,
         per_example=False),
    Case("mse_loss, 10 outputs", "digits_onehot", 10, _regression(F.mse_loss)),
    Case("l1_loss, 10 outputs", "digits_onehot", 10, _regression(F.l1_loss)),
    Case("smooth_l1_loss, 10 outputs", "digits_onehot", 10, _regression(F.smooth_l1_loss)),
    Case("huber_loss, 10 outputs", "digits_onehot", 10, _regression(F.huber_loss)),
    Case("kl_div batchmean", "digits_onehot", 10, _kl("batchmean")),
    Case("kl_div mean", "digits_onehot", 10, _kl("mean")),
    Case("poisson_nll_loss", "digits_counts", 1, _poisson),
    Case("gaussian_nll_loss (mean, log var)", "diabetes", 2, _gaussian),
    Case("multilabel_soft_margin_loss weight", "digits_bits", 4, _multilabel),
    Case("multi_margin_loss weight=0.1-10", "digits", 10, _multi_margin),
    Case("ctc_loss (targets of 1-2)", "digits", 11, _ctc),
    Case("margin_ranking pairs (i, i+B/2)", "diabetes", 1, _ranking_pairs, per_example=False),
    Case("cosine_embedding pairs (i, i+B/2)", "digits", 10, _cosine_pairs, per_example=False),
    Case("cosine_embedding stored pairs (siamese)", "digits_pairs", 10, _cosine_own_pairs),
    Case("triplet stored (a, p), negatives rolled", "digits_pairs", 10, _triplet_rolled, per_example=False),
    Case("triplet stored (a, p, n)", "digits_triplets", 10, _triplet_own),
]


def model_for(case: Case, x: torch.Tensor) -> nn.Module:
    inputs = 8 if case.loss is _ctc else x.shape[-1]
    return mlp(inputs, case.outputs)


# ---------------------------------------------------------------------------------------------------- exact values
def flat_grad(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])


def exact_examples(case: Case, x: torch.Tensor, y: torch.Tensor) -> float:
    """B_simple of each example's own term (``reduction="sum"`` on one example), float64, over the data set."""
    model = model_for(case, x).double()
    xd = x.double()
    yd = y.double() if y.is_floating_point() else y
    rows = torch.stack([flat_grad(model, case.loss(model, xd[i:i + 1], yd[i:i + 1], "sum")) for i in range(len(x))])
    mean = rows.mean(0)
    return float((rows - mean).pow(2).sum(1).mean() / mean.pow(2).sum())


def exact_batch(case: Case, x: torch.Tensor, y: torch.Tensor, draws: int) -> float:
    """``B·tr Cov(G_B)/|E G_B|²`` of the training loss's batch gradient, Monte Carlo, float64."""
    model = model_for(case, x).double()
    xd = x.double()
    yd = y.double() if y.is_floating_point() else y
    generator = torch.Generator().manual_seed(123)
    grads = []
    for _ in range(draws):
        i = torch.randint(0, len(x), (BATCH,), generator=generator)
        grads.append(flat_grad(model, case.loss(model, xd[i], yd[i], "mean")))
    grads = torch.stack(grads)
    centre = grads.mean(0)
    trace = (grads - centre).pow(2).sum(1).mean()
    return float(BATCH * trace / (centre.pow(2).sum() - trace / draws))


# ---------------------------------------------------------------------------------------------------- the meter
def reading(case: Case, x: torch.Tensor, y: torch.Tensor, seed: int, steps: int, check: bool):
    """(run estimate, check status) of the plain-loop meter over ``steps`` batches of stream ``seed``."""
    model = model_for(case, x)
    generator = torch.Generator().manual_seed(seed)
    status = "-"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with GradientNoiseScaleMeter(model) as meter:
            for step in range(steps):
                i = torch.randint(0, len(x), (BATCH,), generator=generator)
                xb, yb = x[i], y[i]
                if check and step == 0:
                    status = first_batch_check(meter, case, model, xb, yb, in_batch=True)
                case.loss(model, xb, yb, "mean").backward()
                meter.step(micro_batch_size=BATCH)  # the size, for the models run twice a step (siamese)
                model.zero_grad()
    return meter.run_estimate, status


def first_batch_check(meter: GradientNoiseScaleMeter, case: Case, model: nn.Module, xb: torch.Tensor,
                      yb: torch.Tensor, in_batch: bool) -> str:
    """``meter.check_per_example`` on the batch: rows copied in the batch (``in_batch``, as the Lightning callback
    does), or at the model's first layer (the README's shortest call)."""
    (xc, yc), _ = first_half_copied((xb, yb), BATCH)
    (xr, yr), _ = first_half_copied((xb, yb), BATCH, from_first_row=True)
    return meter.check_per_example(
        lambda: case.loss(model, xb, yb, "mean").backward(), BATCH,
        run_replaced_pass=(lambda: case.loss(model, xc, yc, "mean").backward()) if in_batch else None,
        run_first_row_pass=(lambda: case.loss(model, xr, yr, "mean").backward()) if in_batch else None).status


def halves_copy_alone(case: Case, x: torch.Tensor, y: torch.Tensor, batches: int) -> tuple[list[str], list[str]]:
    """The statuses on ``batches`` first batches of the check with rows copied in the batch: with the halves' copy
    alone (as before the copy from the first row), and with both copies (as now)."""
    alone, both = [], []
    for seed in range(batches):
        i = torch.randint(0, len(x), (BATCH,), generator=torch.Generator().manual_seed(seed))
        xb, yb = x[i], y[i]
        (xc, yc), _ = first_half_copied((xb, yb), BATCH)
        (xr, yr), _ = first_half_copied((xb, yb), BATCH, from_first_row=True)
        for statuses, first_row in ((alone, False), (both, True)):
            model = model_for(case, x)
            with warnings.catch_warnings(), GradientNoiseScaleMeter(model) as meter:
                warnings.simplefilter("ignore")
                statuses.append(meter.check_per_example(
                    lambda: case.loss(model, xb, yb, "mean").backward(), BATCH,
                    run_replaced_pass=lambda: case.loss(model, xc, yc, "mean").backward(),
                    run_first_row_pass=(lambda: case.loss(model, xr, yr, "mean").backward()) if first_row else None)
                    .status)
    return alone, both


def first_layer_checks(case: Case, x: torch.Tensor, y: torch.Tensor, seeds: int) -> list[str]:
    """Each seed's first batch checked with rows copied at the first layer (no ``run_replaced_pass``)."""
    statuses = []
    for seed in range(seeds):
        model = model_for(case, x)
        i = torch.randint(0, len(x), (BATCH,), generator=torch.Generator().manual_seed(seed))
        with warnings.catch_warnings(), GradientNoiseScaleMeter(model) as meter:
            warnings.simplefilter("ignore")
            statuses.append(first_batch_check(meter, case, model, x[i], y[i], in_batch=False))
    return statuses


def counted(statuses: list[str]) -> str:
    return ", ".join(f"{s} {statuses.count(s)}/{len(statuses)}" for s in sorted(set(statuses)))


def survey_row(case: Case, seeds: int, steps: int, draws: int) -> str:
    x, y = load(case.data)
    examples = exact_examples(case, x, y) if case.per_example else math.nan
    batch = exact_batch(case, x, y, draws)
    checked = [reading(case, x, y, seed, steps, check=True) for seed in range(seeds)]
    estimates = [estimate for estimate, _ in checked]
    refused = any(math.isnan(e.b_simple) for e in estimates)
    if refused:  # what the norms read without the check
        estimates = [reading(case, x, y, seed, steps, check=False)[0] for seed in range(seeds)]
    held = " / ".join("n/a" if math.isnan(value) else f"{sum(e.ci_low <= value <= e.ci_high for e in estimates)}/"
                      f"{seeds}" for value in (examples, batch))
    shown = "; ".join(f"{e.b_simple:.3g} [{e.ci_low:.3g}, {e.ci_high:.3g}]" for e in estimates)
    layer = counted(first_layer_checks(case, x, y, seeds))
    return (f"| {case.name} | {examples:.4g} | {batch:.4g} | {shown}{' (unchecked)' if refused else ''} | "
            f"{held} | {counted([status for _, status in checked])} | {layer} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--draws", type=int, default=4000)
    parser.add_argument("--first-batches", type=int, default=100)
    parser.add_argument("--only", nargs="*", default=None, help="substrings of case names")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| loss | exact: examples | exact: batch | run average [95% CI] per seed | held (examples / batch) | "
          "check (rows copied in the batch) | check (rows copied at the first layer) |")
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        if args.only and not any(part in case.name for part in args.only):
            continue
        print(survey_row(case, args.seeds, args.steps, args.draws), flush=True)
    print(f"\nThe losses built on several examples of the batch, checked on {args.first_batches} first batches with "
          "rows copied in the batch:\n")
    print("| loss | the halves' copy alone (before) | and the copy from the first row (now) |")
    print("|---|---|---|")
    for case in CASES:
        if case.per_example or (args.only and not any(part in case.name for part in args.only)):
            continue
        x, y = load(case.data)
        alone, both = halves_copy_alone(case, x, y, args.first_batches)
        print(f"| {case.name} | {counted(alone)} | {counted(both)} |", flush=True)


if __name__ == "__main__":
    main()
