"""SGD runs to a target training loss, optionally recording the per-step noise-scale quantities.

A run starts from the problem's fixed initialisation, draws batches i.i.d. with replacement (seeded), steps
until the full training-set loss first reaches the target (the crossing is interpolated in log-loss between
evaluations), and stops early when it diverges or is cut (slower than a bound).

Recorded per optimizer step ``t`` (at the parameters the step's gradient is taken at):
``big_sq`` = ``|G_B,t|²`` of the sampled batch, ``batch_loss`` = its mean loss, ``small_sq`` = mean per-example
``|g_i|²`` over the first ``max_examples`` examples of that batch (what the callback's ``per_example`` method
measures), and, every ``exact_every`` steps, the exact ``|G_t|²`` and ``tr Σ_t`` over the whole training set.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.bcrit.problems import ExactSums, Problem
from gns_callback.per_example import PerExampleNormTracker
from gns_callback.recommendation.rules import warmup_lr
from tests.helpers import optimizer_for


@dataclass
class Trace:
    """Per-step quantities along one run (arrays of length ``steps``; exact ones NaN where not measured)."""

    big_sq: np.ndarray
    small_sq: np.ndarray
    batch_loss: np.ndarray  # the step's mean training loss on its batch (what a callback sees)
    examples: int  # per-example norms measured per step
    exact_grad_sq: np.ndarray
    exact_trace: np.ndarray

    def truncate(self, steps: int) -> "Trace":
        return Trace(self.big_sq[:steps], self.small_sq[:steps], self.batch_loss[:steps], self.examples,
                     self.exact_grad_sq[:steps], self.exact_trace[:steps])


@dataclass
class Run:
    batch_size: int
    lr: float
    seed: int
    steps: float  # interpolated steps to the target (inf: not reached)
    status: str  # "reached", "diverged", "stalled", "cut", "budget"
    trace: Optional[Trace] = None
    losses: list[tuple[int, float]] = field(default_factory=list)


def batch_indices(n: int, batch_size: int, seed: int):
    gen = torch.Generator().manual_seed(10_000 + seed)
    while True:
        yield torch.randint(0, n, (batch_size,), generator=gen)


def full_loss(net, x, y, loss=F.cross_entropy) -> float:
    """The loss over the whole set in eval mode (BatchNorm's running statistics, left as they are; the same as train
    mode for a network without BatchNorm or dropout), then back to train mode."""
    net.eval()
    try:
        with torch.no_grad():
            return loss(net(x), y).item()
    finally:
        net.train()


def crossing(prev: tuple[int, float], cur: tuple[int, float], target: float) -> float:
    """Step where the loss crosses ``target`` between two evaluations (linear in log-loss)."""
    (s0, l0), (s1, l1) = prev, cur
    if l1 >= l0 or s1 == s0:
        return float(s1)
    frac = (math.log(l0) - math.log(target)) / (math.log(l0) - math.log(l1))
    return s0 + min(max(frac, 0.0), 1.0) * (s1 - s0)


def train(problem: Problem, data, batch_size: int, lr: float, seed: int, *, max_steps: int, eval_every: int,
          cut_after: float = math.inf, record: bool = False, exact_every: int = 1, max_examples: int = 16,
          diverge_factor: float = 2.0, stall_steps: int = 300, warmup_steps: int = 0,
          warmup_start_lr: Optional[float] = None) -> Run:
    """One run to ``problem.target_loss``; with ``record`` its :class:`Trace` up to the crossing step.

    With ``warmup_steps`` the LR ramps linearly from ``warmup_start_lr`` to ``lr`` over that many steps
    (:func:`gns_callback.recommendation.rules.warmup_lr`, what the recommendation's warmup means)."""
    x, y = data
    net = problem.make_net()
    opt = optimizer_for(problem.optimizer, net.parameters(), lr)
    tracker = PerExampleNormTracker(net, max_examples=max_examples).attach() if record else None
    exact = ExactSums(tracker, x, y, problem.loss) if record else None
    rows: list[tuple[float, float, float, float]] = []
    prev = (0, full_loss(net, x, y, problem.loss))
    losses = [prev]
    initial, status, found = prev[1], "budget", math.inf
    for step, idx in zip(range(1, max_steps + 1), batch_indices(len(x), batch_size, seed)):
        ex = exact(net) if record and (step - 1) % exact_every == 0 else (math.nan, math.nan)
        if warmup_steps:
            for group in opt.param_groups:
                group["lr"] = warmup_lr(step - 1, start_lr=warmup_start_lr, target_lr=lr,
                                        warmup_steps=warmup_steps)
        loss = problem.loss(net(x[idx]), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if record:
            per_example = tracker.pop().double() * batch_size**2  # the mean loss carries 1/B per example
            big = sum(p.grad.double().pow(2).sum() for p in net.parameters()).item()
            rows.append((big, per_example.mean().item(), loss.item(), *ex))
        opt.step()
        if step % eval_every and step != max_steps:
            continue
        cur = (step, full_loss(net, x, y, problem.loss))
        losses.append(cur)
        if not math.isfinite(cur[1]) or cur[1] > diverge_factor * initial:
            status = "diverged"
            break
        if step >= stall_steps and cur[1] > 0.9 * initial:  # dead units or a plateau: not learning
            status = "stalled"
            break
        if cur[1] <= problem.target_loss:
            found, status = crossing(prev, cur, problem.target_loss), "reached"
            break
        prev = cur
        if step > cut_after:
            status = "cut"
            break
    if tracker is not None:
        tracker.detach()
    trace = None
    if record and rows:
        a = np.array(rows)
        m = min(max_examples, batch_size)
        trace = Trace(a[:, 0], a[:, 1], a[:, 2], m, a[:, 3], a[:, 4])
        if math.isfinite(found):
            trace = trace.truncate(int(math.ceil(found)))
    return Run(batch_size, lr, seed, found, status, trace, losses)
