"""A loss divided by a sum over the batch that depends on its examples: ``CrossEntropyLoss(weight=...)``, whose mean
is ``Σ_i w_i l_i / Σ_i w_i``. Per-example norms read each example's weighted gradient; the batch gradient is a
ratio of two sums over the batch. Caught by the first batch's check, which watches the loss's arguments (README,
"When it can't measure"); the readings below are the norms' own, without it.

    python benchmarks/batch_normalised_losses.py [--seeds 5] [--steps 400] [--token-steps 1600]

The digits MLP 64-32-10 at fixed parameters, batches of 32 drawn with replacement, the plain-loop meter at its
defaults. Two exact values: "weighted examples", ``B_simple`` of ``g_i = w_i ∇l_i / mean(w)`` over the data set
(float64, one backward pass per example), what a loss divided by a constant would have; "batch gradient", ``B·tr
Cov(G_B) / |E G_B|²`` of the weighted-mean batch gradient itself, by Monte Carlo over ``--draws`` batches. Then how
far the check's normaliser moves when the second half's rows are copied from the first (``|f − 1|``, 20 batches):
what the check could see. Then the batch gradient's noise at micro-batches of 8 against 32, and what
``method="micro_batch"`` reads at 4 micro-batches of 8: the noise of a ratio changes with the batch size, so neither
method measures one noise scale, and the first batch's check now refuses the loss for both.

Last, a mean over the targets not ignored (padding): a digits token model reads each image's 8 rows as 8 tokens and
predicts the class at every position, each example keeping its first ``L_i`` targets (the rest ``-100``), its loss
``cross_entropy(..., ignore_index=-100)``. The same exact values, with ``g_i = Σ_t ∇l_t / mean(L)`` and the batch
gradient ``Σ_{i∈B} Σ_t ∇l_t / Σ_{i∈B} L_i``, for lengths drawn apart from the examples and lengths set by the class;
then the first batch's check (``check_per_example``), which now refuses it wherever the examples keep unequal counts,
and the same mean written by hand (a mask over its sum), found by the check's copied rows.

Last, an RMSE: ``√(mean_B l_i)`` scales the squared errors' mean gradient by ``1/(2 RMSE_B)``, a factor that moves
with the batch. The diabetes MLP at fixed parameters; exact: ``B_simple`` of the squared errors' gradients, and the
RMSE batch gradient's own noise by Monte Carlo; the check's copied rows move every norm by that factor.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleMeter  # noqa: E402
import gns_callback.per_example.checks as checks  # noqa: E402

WEIGHTINGS = {
    "none": None,
    "0.2-5": torch.tensor([0.2, 0.3, 0.5, 0.7, 1.0, 1.0, 1.5, 2.0, 3.0, 5.0]),
    "0.1-10": torch.tensor([0.1, 0.2, 0.3, 0.5, 1.0, 1.0, 2.0, 3.0, 5.0, 10.0]),
}


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def example_gradients(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each example's unweighted loss gradient, float64, one row per example."""
    net = model().double()
    rows = []
    for i in range(len(x)):
        net.zero_grad()
        F.cross_entropy(net(x[i:i + 1].double()), y[i:i + 1]).backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
    return torch.stack(rows)


def exact_values(rows: torch.Tensor, w: torch.Tensor, draws: int, batch: int) -> tuple[float, float]:
    """(weighted examples, batch gradient): see the module docstring."""
    g = w[:, None] * rows / w.mean()
    mean = g.mean(0)
    examples = float((g - mean).pow(2).sum(1).mean() / mean.pow(2).sum())
    generator, grads = torch.Generator().manual_seed(123), []
    for _ in range(draws):
        i = torch.randint(0, len(rows), (batch,), generator=generator)
        grads.append((w[i, None] * rows[i]).sum(0) / w[i].sum())
    grads = torch.stack(grads)
    centre = grads.mean(0)
    return examples, float(batch * (grads - centre).pow(2).sum(1).mean() / centre.pow(2).sum())


def meter_reading(x: torch.Tensor, y: torch.Tensor, weight, seed: int, steps: int, batch: int):
    net = model()
    generator = torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(net) as meter:
        for _ in range(steps):
            i = torch.randint(0, len(x), (batch,), generator=generator)
            F.cross_entropy(net(x[i]), y[i], weight=weight).backward()
            meter.step()
            net.zero_grad()
    return meter.run_estimate


def micro_batch_reading(x: torch.Tensor, y: torch.Tensor, weight, seed: int, steps: int, micro: int = 8,
                        passes: int = 4):
    """The meter with ``method="micro_batch"``: ``passes`` micro-batches of ``micro`` per step, each its own weighted
    mean (as accumulation runs it)."""
    net = model()
    generator = torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(net, method="micro_batch") as meter:
        for _ in range(steps):
            for _ in range(passes):
                i = torch.randint(0, len(x), (micro,), generator=generator)
                (F.cross_entropy(net(x[i]), y[i], weight=weight) / passes).backward()
            meter.step(micro_batch_size=micro)
            net.zero_grad()
    return meter.run_estimate


class _Unwatched:
    """Stands in for the check's watch of the loss (:mod:`gns_callback.per_example.weighted_mean`), which refuses
    these losses before the rows are compared: what the comparison alone would see."""

    found = None

    def __init__(self, batch_size: Optional[int] = None) -> None:
        self.batch_size = batch_size

    def __enter__(self) -> "_Unwatched":
        return self

    def __exit__(self, *exc: object) -> bool:
        return False


def normaliser_moves(x: torch.Tensor, y: torch.Tensor, weight, batch: int, batches: int = 20) -> torch.Tensor:
    """``|f − 1|`` of the check's common factor, with the batch's rows copied before the loss (as in Lightning): the
    first copy's (the second half's rows from the first half's; a second copy, from the first row, may follow)."""
    factors: list[list[float]] = []
    compare, watch = checks._compare, checks.WeightedMeanWatch

    def recording(before, after, half, tolerance):
        if after is not None and not factors[-1]:
            count = min(half, before.shape[0])
            factors[-1].append(float((after[:count] / before[:count]).median()))
        return compare(before, after, half, tolerance)

    checks._compare, checks.WeightedMeanWatch = recording, _Unwatched
    try:
        net = model()
        for seed in range(batches):
            factors.append([])
            i = torch.randint(0, len(x), (batch,), generator=torch.Generator().manual_seed(seed))
            j = torch.cat([i[:batch // 2], i[:batch // 2]])
            checks.check_per_example(net, lambda: F.cross_entropy(net(x[i]), y[i], weight=weight).backward(), batch,
                                     reset=lambda: None,
                                     run_replaced_pass=lambda: F.cross_entropy(net(x[j]), y[j], weight=weight).backward())
    finally:
        checks._compare, checks.WeightedMeanWatch = compare, watch
    return (torch.tensor([f for first in factors for f in first]) - 1).abs()


class TokenNet(nn.Module):
    """Each row of a digit a token: ``tanh(Linear(8, 32))``, a causal running mean, ``Linear(32, 10)`` per position."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(8, 32), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(h.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype)[None, :, None])


def token_lengths(y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Targets kept per example: all, drawn apart from the examples, or set by the class."""
    generator = torch.Generator().manual_seed(7)
    return {"all 8": torch.full_like(y, 8),
            "1–8, drawn apart": torch.randint(1, 9, y.shape, generator=generator),
            "1–8, by class": 1 + (y * 7) // 9,
            "8 for class 0, else 1": torch.where(y == 0, 8, 1)}


def token_targets(y: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The class at each of 8 positions, ``-100`` past the example's length."""
    targets = y[:, None].repeat(1, 8)
    targets[torch.arange(8)[None, :] >= lengths[:, None]] = -100
    return targets


def token_loss(net: nn.Module, x: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(net(x).reshape(-1, 10), targets.reshape(-1), reduction=reduction)


def masked_token_loss(net: nn.Module, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same mean written by hand, a mask divided by its sum: what the loss watch can't see."""
    kept = targets != -100
    per_token = F.cross_entropy(net(x).transpose(1, 2), torch.where(kept, targets, 0), reduction="none")
    return (per_token * kept).sum() / kept.sum()


def token_rows(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each example's summed token-loss gradient ``Σ_t ∇l_t``, float64, one row per example."""
    net, rows = TokenNet().double(), []
    for i in range(len(x)):
        net.zero_grad()
        token_loss(net, x[i:i + 1].double(), targets[i:i + 1], "sum").backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
    return torch.stack(rows)


def token_reading(x: torch.Tensor, targets: torch.Tensor, seed: int, steps: int, batch: int = 32):
    """(the first batch's check of ``token_loss`` and of :func:`masked_token_loss`, the batch copied as the Lightning
    callback copies it; the run average of the hooks without a check)."""
    net, generator = TokenNet(), torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(net) as meter:
        for step in range(steps):
            i = torch.randint(0, len(x), (batch,), generator=generator)
            token_loss(net, x[i], targets[i]).backward()
            meter.step()
            net.zero_grad()
    first = torch.randint(0, len(x), (batch,), generator=torch.Generator().manual_seed(seed))
    copied = torch.cat([first[:batch // 2], first[:batch // 2]])
    statuses = tuple(checks.check_per_example(net, lambda: loss(net, x[first], targets[first]).backward(), batch,
                                              reset=lambda: None,
                                              run_replaced_pass=lambda: loss(net, x[copied], targets[copied]).backward()
                                              ).status
                     for loss in (token_loss, masked_token_loss))
    return statuses, meter.run_estimate


def token_table(x: torch.Tensor, y: torch.Tensor, seeds: int, steps: int, draws: int) -> None:
    tokens = x.reshape(-1, 8, 8)
    print(f"\nA mean over the targets not ignored (digits token model, batch 32, {steps} steps):\n")
    print("| targets kept per example | CV of the count | exact: examples | exact: batch gradient at 8 | at 32 | "
          "run average [95% CI] per seed, without the check | held (examples / batch gradient at 32) | the check: "
          "`ignore_index` | the check: a mask by hand |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, lengths in token_lengths(y).items():
        targets = token_targets(y, lengths)
        rows, counts = token_rows(tokens, targets), lengths.double()
        per_token = rows / counts[:, None]  # as exact_values weighs it: w_i = L_i, w_i · row_i = Σ_t ∇l_t
        examples, at_8 = exact_values(per_token, counts, draws, 8)
        at_32 = exact_values(per_token, counts, draws, 32)[1]
        results = [token_reading(tokens, targets, seed, steps) for seed in range(seeds)]
        readings = [r for _, r in results]
        held = [sum(r.ci_low <= value <= r.ci_high for r in readings) for value in (examples, at_32)]
        shown = "; ".join(f"{r.b_simple:.1f} [{r.ci_low:.1f}, {r.ci_high:.1f}]" for r in readings)
        print(f"| {name} | {float(counts.std() / counts.mean()):.2f} | {examples:.2f} | {at_8:.2f} | {at_32:.2f} | "
              f"{shown} | {held[0]}/{seeds} / {held[1]}/{seeds} | {_statuses(results, 0)} | {_statuses(results, 1)} |")


def _statuses(results: list, which: int) -> str:
    return ", ".join(sorted({statuses[which] for statuses, _ in results}))


def diabetes() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's diabetes data, features and target standardised."""
    from sklearn.datasets import load_diabetes
    data = load_diabetes()
    x, y = torch.tensor(data.data, dtype=torch.float32), torch.tensor(data.target, dtype=torch.float32)[:, None]
    return (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()


def regression_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))


def rmse_loss(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x), y).sqrt()


def rmse_exact(x: torch.Tensor, y: torch.Tensor, draws: int, batch: int) -> tuple[float, float]:
    """(``B_simple`` of the examples' squared-error gradients, ``B·tr Cov(G_B)/|E G_B|²`` of RMSE's batch gradient
    ``mean_B ∇l_i / (2 √mean_B l_i)``), float64, by Monte Carlo over ``draws`` batches."""
    net, rows, losses = regression_model().double(), [], []
    for i in range(len(x)):
        net.zero_grad()
        loss = F.mse_loss(net(x[i:i + 1].double()), y[i:i + 1].double(), reduction="sum")
        loss.backward()
        rows.append(torch.cat([p.grad.reshape(-1) for p in net.parameters()]))
        losses.append(float(loss.detach()))
    rows, per_example = torch.stack(rows), torch.tensor(losses, dtype=torch.float64)
    mean = rows.mean(0)
    examples = float((rows - mean).pow(2).sum(1).mean() / mean.pow(2).sum())
    generator, grads = torch.Generator().manual_seed(123), []
    for _ in range(draws):
        i = torch.randint(0, len(rows), (batch,), generator=generator)
        grads.append(rows[i].mean(0) / (2 * per_example[i].mean().sqrt()))
    grads = torch.stack(grads)
    centre = grads.mean(0)
    return examples, float(batch * (grads - centre).pow(2).sum(1).mean() / centre.pow(2).sum())


def rmse_reading(x: torch.Tensor, y: torch.Tensor, seed: int, steps: int, rmse: bool, batch: int = 32):
    net, generator = regression_model(), torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(net) as meter:
        for _ in range(steps):
            i = torch.randint(0, len(x), (batch,), generator=generator)
            (rmse_loss(net, x[i], y[i]) if rmse else F.mse_loss(net(x[i]), y[i])).backward()
            meter.step()
            net.zero_grad()
    return meter.run_estimate


def rmse_check(x: torch.Tensor, y: torch.Tensor, batch: int = 32):
    """The first batch's check of RMSE (rows copied at the first layer: RMSE's factor moves either way)."""
    first = torch.randint(0, len(x), (batch,), generator=torch.Generator().manual_seed(0))
    net = regression_model()
    return checks.check_per_example(net, lambda: rmse_loss(net, x[first], y[first]).backward(), batch,
                                    reset=lambda: None)


def rmse_table(seeds: int, steps: int, draws: int) -> None:
    x, y = diabetes()
    examples, at_32 = rmse_exact(x, y, draws, 32)
    at_8 = rmse_exact(x, y, draws, 8)[1]
    check = rmse_check(x, y)
    print(f"\nThe square root of a mean (diabetes MLP 10-32-1, standardised, batch 32, {steps} steps): exact "
          f"examples {examples:.2f}, RMSE's batch gradient {at_8:.2f} at 8 and {at_32:.2f} at 32; the check on "
          f"RMSE: {check.status}\n")
    print("| loss | run average [95% CI] per seed, without the check | held (examples / RMSE's batch gradient) |")
    print("|---|---|---|")
    for name, rmse in (("MSE", False), ("RMSE", True)):
        readings = [rmse_reading(x, y, seed, steps, rmse) for seed in range(seeds)]
        held = [sum(r.ci_low <= value <= r.ci_high for r in readings) for value in (examples, at_32)]
        shown = "; ".join(f"{r.b_simple:.2f} [{r.ci_low:.2f}, {r.ci_high:.2f}]" for r in readings)
        print(f"| {name} | {shown} | {held[0]}/{seeds} / {held[1]}/{seeds} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--draws", type=int, default=20000)
    parser.add_argument("--token-steps", type=int, default=1600,
                        help="steps of the token model (B_simple/B up to 4.5 there: the run average's small-sample "
                             "bias is larger at 400)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = digits()
    rows = example_gradients(x, y)
    print("| class weights | exact: weighted examples | exact: batch gradient | run average [95% CI] per seed | "
          "held (examples / batch gradient) | check's normaliser moved, median and max |")
    print("|---|---|---|---|---|---|")
    for name, weight in WEIGHTINGS.items():
        w = (torch.ones(10) if weight is None else weight).double()[y]
        examples, batch_gradient = exact_values(rows, w, args.draws, 32)
        readings = [meter_reading(x, y, weight, seed, args.steps, 32) for seed in range(args.seeds)]
        held = [sum(r.ci_low <= value <= r.ci_high for r in readings) for value in (examples, batch_gradient)]
        moves = normaliser_moves(x, y, weight, 32)
        shown = "; ".join(f"{r.b_simple:.1f} [{r.ci_low:.1f}, {r.ci_high:.1f}]" for r in readings)
        print(f"| {name} | {examples:.2f} | {batch_gradient:.2f} | {shown} | {held[0]}/{len(readings)} / "
              f"{held[1]}/{len(readings)} | {float(moves.median()):.1%}, {float(moves.max()):.0%} |")
    print("\nThe batch gradient's own noise at micro-batches of 8, and `method=\"micro_batch\"` (4 × 8 a step):\n")
    print("| class weights | exact: batch gradient at 8 | at 32 | micro_batch run average [95% CI] per seed |")
    print("|---|---|---|---|")
    for name, weight in WEIGHTINGS.items():
        w = (torch.ones(10) if weight is None else weight).double()[y]
        at_8, at_32 = (exact_values(rows, w, args.draws, size)[1] for size in (8, 32))
        readings = [micro_batch_reading(x, y, weight, seed, args.steps) for seed in range(args.seeds)]
        shown = "; ".join(f"{r.b_simple:.1f} [{r.ci_low:.1f}, {r.ci_high:.1f}]" for r in readings)
        print(f"| {name} | {at_8:.2f} | {at_32:.2f} | {shown} |")
    token_table(x, y, args.seeds, args.token_steps, args.draws)
    rmse_table(args.seeds, 2 * args.steps, args.draws)


if __name__ == "__main__":
    main()
