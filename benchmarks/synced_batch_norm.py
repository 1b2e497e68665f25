"""``micro_batch`` under DDP with SyncBatchNorm, simulated on one CPU, against the noise scale of the run's gradient.

With ``SyncBatchNorm`` (Lightning's ``sync_batchnorm=True``) every rank normalises with the statistics of the global
batch, and its backward all-reduces the statistics' gradients: rank ``r``'s local gradient (what ``micro_batch``'s
hooks see before DDP's reduction) is its examples' share of the global batch gradient, coupled to every other rank's
examples. ``micro_batch`` takes those shares for independent micro-batch gradients.

The digits BatchNorm CNN (``benchmarks/bcrit/problems.py``, ``cnn_bn``) at fixed parameters (lr = 0; after
``--train-steps`` SGD steps at batch 32, lr 0.4), K ranks of b examples each, batches drawn with replacement:

* *synced*: rank gradients as SyncBatchNorm makes them (one BatchNorm over the K·b examples, a copy of every
  parameter per rank, so that autograd gives each rank's share, as the all-reduced backward does);
* *local*: plain BatchNorm per rank (DDP without ``sync_batchnorm``), where ranks are independent;
* the reading is ``micro_batch``'s unbiased pair (small = the ranks' gradients at b, big = their mean at K·b) as a
  ratio of sums over the draws, with a bootstrap 95% interval over draws;
* the value to hit: ``B·tr Var(g_B)/|E g_B|²`` of the step's gradient ``g_B`` (B = K·b, BatchNorm over B for
  *synced*; the mean of K independent b-gradients for *local*), by Monte Carlo over the same number of draws of
  fresh batches (the variance and an unbiased ``|E g|²`` over the draws), with its bootstrap interval.

    python benchmarks/synced_batch_norm.py --ranks 2 4 --per-rank 8 16 --draws 2000
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bcrit.problems import cnn_bn, digits  # noqa: E402
from benchmarks.bcrit.training import batch_indices  # noqa: E402


def trained_params(steps: int) -> dict[str, torch.Tensor]:
    """``cnn_bn``'s parameters after ``steps`` SGD steps at batch 32, lr 0.4 (seed 0)."""
    x, y = digits()
    net = cnn_bn()
    opt = torch.optim.SGD(net.parameters(), lr=0.4)
    for _, idx in zip(range(steps), batch_indices(len(x), 32, 0)):
        opt.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
    names = ("c1.w", "c1.b", "bn.w", "bn.b", "c2.w", "c2.b", "fc.w", "fc.b")
    return {n: p.detach().clone() for n, p in zip(names, net.parameters())}


def rank_grads(params: dict[str, torch.Tensor], xs: list[torch.Tensor], ys: list[torch.Tensor],
               synced: bool) -> torch.Tensor:
    """(K, P): each rank's local gradient of its mean loss; BatchNorm over all ranks (``synced``) or per rank."""
    copies = [{n: p.clone().requires_grad_() for n, p in params.items()} for _ in xs]
    h = [F.conv2d(x.view(-1, 1, 8, 8), c["c1.w"], c["c1.b"], padding=1) for c, x in zip(copies, xs)]
    if synced:
        h = list(F.batch_norm(torch.cat(h), None, None, training=True, eps=1e-5).split([len(x) for x in xs]))
    else:
        h = [F.batch_norm(part, None, None, training=True, eps=1e-5) for part in h]
    loss = 0.0
    for c, part, y in zip(copies, h, ys):
        a = F.relu(part * c["bn.w"][None, :, None, None] + c["bn.b"][None, :, None, None])
        a = F.relu(F.conv2d(a, c["c2.w"], c["c2.b"], stride=2, padding=1)).flatten(1)
        loss = loss + F.cross_entropy(F.linear(a, c["fc.w"], c["fc.b"]), y)
    flat = [p for c in copies for p in c.values()]
    grads = torch.autograd.grad(loss, flat)
    n = len(params)
    return torch.stack([torch.cat([g.flatten() for g in grads[r * n:(r + 1) * n]]) for r in range(len(xs))]).double()


def bootstrap(values: np.ndarray, stat, reps: int = 400, seed: int = 0) -> tuple[float, float, float]:
    rng = np.random.default_rng(seed)
    boots = [stat(values[rng.integers(0, len(values), len(values))]) for _ in range(reps)]
    return stat(values), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def study(params, x, y, ranks: int, per_rank: int, draws: int, synced: bool, seed: int = 0) -> dict:
    big_b = ranks * per_rank
    gen = torch.Generator().manual_seed(seed)
    rows, steps = [], []
    for _ in range(draws):
        idx = torch.randint(0, len(x), (big_b,), generator=gen)
        g = rank_grads(params, list(x[idx].split(per_rank)), list(y[idx].split(per_rank)), synced)
        mean = g.mean(0)
        rows.append((g.pow(2).sum(1).mean().item(), mean.pow(2).sum().item()))
        steps.append(mean.numpy())
    small, big = np.array(rows).T
    b, bb = float(per_rank), float(big_b)

    def reading(pairs: np.ndarray) -> float:
        s, g = pairs[:, 0].mean(), pairs[:, 1].mean()
        trace = (s - g) / (1 / b - 1 / bb)
        grad = (bb * g - b * s) / (bb - b)
        return trace / grad if grad > 0 else np.inf

    def truth(gs: np.ndarray) -> float:
        mu = gs.mean(0)
        var = gs.var(0, ddof=1).sum()
        grad = mu @ mu - var / len(gs)
        return bb * var / grad if grad > 0 else np.inf

    return dict(ranks=ranks, per_rank=per_rank, synced=synced, reading=bootstrap(np.stack([small, big], 1), reading),
                truth=bootstrap(np.stack(steps), truth, reps=200))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--per-rank", nargs="+", type=int, default=[8, 16])
    parser.add_argument("--draws", type=int, default=2000)
    parser.add_argument("--train-steps", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x, y = digits()
    params = trained_params(args.train_steps)
    print(f"cnn_bn after {args.train_steps} steps (batch 32, lr 0.4); {args.draws} draws per row\n")
    print("| BatchNorm | ranks × per-rank batch | micro_batch reading [95%] | B_noise of the step's gradient "
          "(Monte Carlo) [95%] | reading / value | reading's interval holds it |")
    print("|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for per_rank in args.per_rank:
            for synced in (True, False):
                r = study(params, x, y, ranks, per_rank, args.draws, synced)
                (v, lo, hi), (t, tlo, thi) = r["reading"], r["truth"]
                print(f"| {'SyncBatchNorm' if synced else 'per rank'} | {ranks} × {per_rank} | {v:.4g} [{lo:.4g}, "
                      f"{hi:.4g}] | {t:.4g} [{tlo:.4g}, {thi:.4g}] | {v / t:.2f} | "
                      f"{'yes' if lo <= t <= hi else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
