#!/usr/bin/env python
"""What the first batch's checks of per-example norms read, and what they cost.

    python benchmarks/per_example_checks.py [--out benchmarks/RESULTS.md]

For each model and loss, on a batch of 32 of scikit-learn's digits (pixels, or the 64 pixel intensities as tokens),
what :mod:`gns_callback.per_example.checks` reads: a gradient part no example's norm carries ("extra gradient":
its share of the parameter's gradient where it changes with the examples, or how much it moves ``tr Σ`` where it
is the same for all, refused above 1%), or else the spread of the first half's per-example norm ratios between the
passes (above 0.1% reads as coupled; where they agree, their common factor's distance from 1, above 0.1% read as
"scaled by the batch"), the later passes on the batch with its second half's rows copied from the first half's,
then (where that reads independent) from its first row, as the Lightning callback runs it; and the check's CPU time
against one forward and backward of the same batch (medians of 7, one thread). Losses of per-example terms, whatever
they draw at random, should read 0 or rounding; losses and layers over the batch should read well above 0.1%.

A second table is for your own loop without ``meter.check_per_example``: there the meter checks the sums on its
first measured step alone. For the cases with a gradient part no norm carries and an exact value (a functional head
on the token table; L2 terms, whose exact per-example gradient is the loss term's plus the penalty's), 5 streams of
300 steps of batch 32 at the model's initial parameters: what the run average read with that first-step check off
(as every version before it did) against the exact ``B_simple`` over all 1797 digits, and what the meter does now.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from benchmarks.model_scan import MODELS, digits_and_tokens  # noqa: E402
from benchmarks.results import publish_section  # noqa: E402
from gns_callback.batch_size import first_half_copied  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from gns_callback.meter import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.per_example.checks import IMPACT, TOLERANCE, check_per_example  # noqa: E402
from gns_callback.probe.state import preserved_state  # noqa: E402

BATCH = 32
Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def mlp(dropout: float = 0.0, batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(32) if batch_norm else nn.Identity()
    return nn.Sequential(nn.Linear(64, 32), norm, nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 10))


def contrastive(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = F.normalize(model(x), dim=1)
    return F.cross_entropy(z @ z.T / 0.5, torch.arange(len(z)))


def supervised_contrastive(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Khosla et al. 2020: the positives of an example are the batch's other examples of its class."""
    z = F.normalize(model(x), dim=1)
    logits = (z @ z.T / 0.5).fill_diagonal_(-1e9)
    positives = (y[:, None] == y[None, :]).float().fill_diagonal_(0)
    log_prob = logits.log_softmax(1).masked_fill(positives == 0, 0.0)
    return -(log_prob.sum(1) / positives.sum(1).clamp_min(1)).mean()


def triplet_hardest(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Batch-hard triplet loss (Hermans et al. 2017): in-batch mining."""
    z = model(x)
    d = torch.cdist(z, z)
    same = y[:, None] == y[None, :]
    hardest_pos = (d * same).max(1).values
    hardest_neg = d.masked_fill(same, float("inf")).min(1).values
    return F.relu(hardest_pos - hardest_neg + 1.0).mean()


def mixup(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    perm, lam = torch.randperm(len(x)), 0.7
    out = model(lam * x + (1 - lam) * x[perm])
    return lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm])


def cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def l2_penalised(strength: float) -> Loss:
    """Cross-entropy plus ``strength·|θ|²``: a gradient part the same for every example."""
    return lambda m, x, y: cross_entropy(m, x, y) + strength * sum(p.pow(2).sum() for p in m.parameters())


class HeadOnTheTable(nn.Module):
    """Tokens through an embedding, mean-pooled, scored against the same table functionally (``h @ E.T``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix = nn.Embedding(17, 16), nn.Linear(16, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mix(self.embed(tokens).mean(1))) @ self.embed.weight[:10].T


def clamped_gradient() -> nn.Module:
    """The first layer's weight gradient clamped by a hook on the parameter."""
    model = mlp()
    model[0].weight.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
    return model


def masked_mean(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over the batch's examples of class 5 or above only: a mask divided by its sum."""
    kept = (y >= 5).float()
    return (F.cross_entropy(m(x), y, reduction="none") * kept).sum() / kept.sum()


CASES: list[tuple[str, Callable[[], nn.Module], Loss, bool, str]] = [  # name, model, loss, tokens, expected
    ("MLP, cross-entropy (mean)", mlp, cross_entropy, False, "independent"),
    ("MLP, cross-entropy (sum)", mlp, lambda m, x, y: F.cross_entropy(m(x), y, reduction="sum"), False,
     "independent"),
    ("MLP + dropout 0.3, cross-entropy", lambda: mlp(0.3), cross_entropy, False, "independent"),
    ("MLP, RMSE of per-example losses", mlp,
     lambda m, x, y: F.cross_entropy(m(x), y, reduction="none").pow(2).mean().sqrt(), False, "scaled by the batch"),
    ("MLP, a mean over the examples of class ≥ 5 (a mask by hand)", mlp, masked_mean, False, "scaled by the batch"),
    ("MLP, mixup in the step", mlp, mixup, False, "coupled"),
    ("MLP, in-batch contrastive (InfoNCE)", mlp, contrastive, False, "coupled"),
    ("MLP, supervised contrastive", mlp, supervised_contrastive, False, "coupled"),
    ("MLP, batch-hard triplet", mlp, triplet_hardest, False, "coupled"),
    ("MLP, logits centred on the batch mean", mlp,
     lambda m, x, y: F.cross_entropy(m(x) - m(x).mean(0, keepdim=True), y), False, "coupled"),
    ("MLP + BatchNorm (training mode), cross-entropy", lambda: mlp(batch_norm=True), cross_entropy, False,
     "coupled"),
    ("MLP, cross-entropy + 1e-4·‖θ‖²", mlp, l2_penalised(1e-4), False, "independent"),
    ("MLP, cross-entropy + 0.1·‖θ‖²", mlp, l2_penalised(0.1), False, "extra gradient"),
    ("MLP, a hook clamping one weight's gradient", clamped_gradient, cross_entropy, False, "extra gradient"),
    ("tokens, head on the embedding table (h @ E.T)", HeadOnTheTable, cross_entropy, True, "extra gradient"),
    *[(f"{name}, cross-entropy", make, cross_entropy, tokens, "independent")
      for name, (make, tokens) in MODELS.items()],
]


def cpu_ms(work: Callable[[], object], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        work()
        times.append((time.thread_time() - start) * 1e3)
    return statistics.median(times)


def measure(make: Callable[[], nn.Module], loss: Loss, x: torch.Tensor, y: torch.Tensor) -> tuple[object, float, float]:
    model = make()

    (x_copied, y_copied), _ = first_half_copied((x, y), BATCH)
    (x_row, y_row), _ = first_half_copied((x, y), BATCH, from_first_row=True)

    def run_pass() -> None:
        loss(model, x, y).backward()

    def run_replaced_pass() -> None:  # rows copied in the batch, as the Lightning callback does
        loss(model, x_copied, y_copied).backward()

    def run_first_row_pass() -> None:  # the second copy, every row of the second half the first row's
        loss(model, x_row, y_row).backward()

    def check():
        with preserved_state(model, []) as state:
            return check_per_example(model, run_pass, BATCH, reset=state.restore, run_replaced_pass=run_replaced_pass,
                                     run_first_row_pass=run_first_row_pass)

    def step() -> None:
        with preserved_state(model, []):
            run_pass()

    return check(), cpu_ms(check), cpu_ms(step)


#: Own-loop cases: name, model, loss, tokens, the L2 strength in the loss (its gradient is added to every example's).
OWN_LOOP: list[tuple[str, Callable[[], nn.Module], Loss, bool, float]] = [
    ("MLP, cross-entropy", mlp, cross_entropy, False, 0.0),
    ("MLP, cross-entropy + 1e-4·‖θ‖²", mlp, l2_penalised(1e-4), False, 1e-4),
    ("MLP, cross-entropy + 1e-3·‖θ‖²", mlp, l2_penalised(1e-3), False, 1e-3),
    ("MLP, cross-entropy + 0.1·‖θ‖²", mlp, l2_penalised(0.1), False, 0.1),
    ("tokens, head on the embedding table (h @ E.T)", HeadOnTheTable, cross_entropy, True, 0.0),
]
STREAMS, STEPS = 5, 300


def exact_with_penalty(model: nn.Module, x: torch.Tensor, y: torch.Tensor, strength: float) -> float:
    """Exact ``B_simple`` of cross-entropy plus ``strength·|θ|²``: each example's gradient plus ``2·strength·θ``."""
    grads = per_example_gradients(model, F.cross_entropy, x, y)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    return exact_noise_scale(grads + 2 * strength * theta)[0]


def own_loop_reading(model: nn.Module, loss: Loss, x: torch.Tensor, y: torch.Tensor, seed: int,
                     first_step_check: bool) -> GradientNoiseScaleMeter:
    draws = torch.Generator().manual_seed(seed)
    with GradientNoiseScaleMeter(model) as meter:
        if not first_step_check:
            meter._arm_sum_check(False)  # the meter as it was before the check
        for _ in range(STEPS):
            i = torch.randint(0, len(x), (BATCH,), generator=draws)
            loss(model, x[i], y[i]).backward()
            meter.step()
            model.zero_grad()
    return meter


def own_loop_row(name: str, make: Callable[[], nn.Module], loss: Loss, x: torch.Tensor, y: torch.Tensor,
                 strength: float) -> str:
    model = make()
    exact = exact_with_penalty(model, x, y, strength)
    before = [own_loop_reading(model, loss, x, y, seed, False) for seed in range(STREAMS)]
    estimates = [meter.run_estimate for meter in before]
    holds = sum(e.ci_low <= exact <= e.ci_high for e in estimates)
    mean = statistics.fmean(e.b_simple for e in estimates)
    now = own_loop_reading(model, loss, x, y, 0, True)
    check = now.per_example_check
    if now.failure is None:
        same = "same numbers" if now.run_estimate == before[0].run_estimate else "**numbers differ**"
        read = f"measured ({check.status}), {same} as stream 0 before"
    elif check.detail.startswith("a part of the gradient the same for every example"):
        read = f"not measured ({check.status}): a penalty moving tr Σ by {check.spread:.1%}"
    else:
        read = f"not measured ({check.status}): {check.spread:.1%} of a parameter's gradient not in the norms"
    first = estimates[0]
    return (f"| {name} | {exact:.1f} | {mean:.1f} | {first.b_simple:.1f} [{first.ci_low:.1f}, {first.ci_high:.1f}] | "
            f"{holds} of {STREAMS} | {read} |")


def own_loop_section(pixels: torch.Tensor, tokens: torch.Tensor, y: torch.Tensor) -> str:
    rows = ["| model, loss | exact B_simple | before: mean reading | before: stream 0 [95% CI] | before: interval "
            "holds exact | now |", "|---|---|---|---|---|---|"]
    for name, make, loss, reads_tokens, strength in OWN_LOOP:
        rows.append(own_loop_row(name, make, loss, tokens if reads_tokens else pixels, y, strength))
    return ("In your own loop without `meter.check_per_example` (`GradientNoiseScaleMeter`, `per_example`, the "
            f"defaults): {STREAMS} streams of {STEPS} steps of batch {BATCH} at the initial parameters, all 1797 "
            "digits; \"before\" is the meter with its first-step check switched off, as every version before it.\n\n"
            + "\n".join(rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="replace this section of a markdown file (e.g. benchmarks/RESULTS.md)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    all_pixels, all_tokens, all_y = digits_and_tokens()
    pixels, tokens, y = all_pixels[:BATCH], all_tokens[:BATCH], all_y[:BATCH]
    rows = ["| model, loss | expected | read | spread or share | check, CPU ms | one forward + backward, CPU ms |",
            "|---|---|---|---|---|---|"]
    for name, make, loss, reads_tokens, expected in CASES:
        result, check_ms, step_ms = measure(make, loss, tokens if reads_tokens else pixels, y)
        read = result.status if result.status == expected else f"**{result.status}**"
        rows.append(f"| {name} | {expected} | {read} | {result.spread:.1e} | {check_ms:.1f} | {step_ms:.1f} |")
    intro = (f"Command: `python benchmarks/per_example_checks.py`. Batch {BATCH} of digits, one thread, "
             f"torch {torch.__version__}. Thresholds: a norm-ratio spread > {TOLERANCE:g} reads as coupled, and "
             f"otherwise their common factor further than {TOLERANCE:g} from 1 as scaled by the batch (the column "
             f"then shows that distance); a gradient part no norm carries is refused where it changes with the "
             f"examples, or moves tr Σ by > {IMPACT:g}. The check's time includes putting the state back between and "
             "after its passes (three where the first copy reads independent: the second half's rows copied from the "
             "first half's, then from its first row).")
    own_loop = own_loop_section(all_pixels, all_tokens, all_y)
    publish_section(intro + "\n\n" + "\n".join(rows) + "\n\n" + own_loop, args.out,
                    "## The first batch's checks of per-example norms")


if __name__ == "__main__":
    main()
