"""``benchmarks/payoff.py``: the warmup it follows is the recommendation's, and its verdicts read the issue's targets."""

from __future__ import annotations

import math

import pytest

from benchmarks.bcrit.problems import PROBLEMS
from benchmarks.bcrit.sweep import BatchSweep
from benchmarks.bcrit.training import Run, train
from gns_callback.recommendation import warmup_lr


@pytest.fixture(scope="module")
def payoff(load_benchmark):
    return load_benchmark("payoff")


def test_position_and_targets(payoff):
    assert [payoff.where(b, 32.0) for b in (8, 10, 32, 95, 96, 512)] == [
        "far below", "far below", "near", "near", "far above", "far above"]
    ok = dict(steps=0.5, examples=0.4, vs_tuned=1.2, diverged=0, not_reached=0)
    assert payoff.meets("far below", ok) and payoff.meets("far above", ok) and payoff.meets("near", ok)
    assert not payoff.meets("far below", {**ok, "steps": 0.7})
    assert not payoff.meets("far above", {**ok, "steps": 2.6}) and not payoff.meets("far above", {**ok, "examples": 0.6})
    assert not payoff.meets("near", {**ok, "diverged": 1}) and not payoff.meets("near", {**ok, "vs_tuned": 1.31})


def test_case_numbers_are_ratios_of_medians(payoff):
    def runs(*steps):
        return [Run(0, 0.1, s, v, "reached") for s, v in enumerate(steps)]

    start = BatchSweep(8, [], {0.5: runs(100.0, 120.0, 140.0)}, 0.5)
    at_rec = BatchSweep(32, [], {1.0: runs(40.0, 50.0, 60.0)}, 1.0)
    case = payoff.Case("mlp", 8, start, {"batch_size": 32, "learning_rate": 1.0}, 100, runs(55.0, 60.0, math.inf),
                       at_rec, 1.0)
    n = payoff.case_numbers(case)
    assert (n["s0"], n["s1"], n["steps"]) == (120.0, 60.0, 0.5)
    assert n["examples"] == pytest.approx(2.0) and n["vs_tuned"] == pytest.approx(1.2) and n["not_reached"] == 1


def test_training_warmup_is_the_recommendations_ramp():
    """The benchmark's loop with a warmup equals a hand-written SGD loop stepping at ``warmup_lr``."""
    import torch
    import torch.nn.functional as F

    from benchmarks.bcrit.training import batch_indices, full_loss

    problem = PROBLEMS["mlp"]
    x, y = problem.data()
    run = train(problem, (x, y), 16, 1.0, 0, max_steps=6, eval_every=1, warmup_steps=4, warmup_start_lr=0.25,
                diverge_factor=math.inf)
    net = problem.make_net()
    opt = torch.optim.SGD(net.parameters(), lr=1.0)
    expected = [full_loss(net, x, y)]
    for step, idx in zip(range(6), batch_indices(len(x), 16, 0)):
        opt.param_groups[0]["lr"] = warmup_lr(step, start_lr=0.25, target_lr=1.0, warmup_steps=4)
        opt.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        opt.step()
        expected.append(full_loss(net, x, y))
    assert [loss for _, loss in run.losses] == pytest.approx(expected, rel=1e-6)
    no_warmup = train(problem, (x, y), 16, 1.0, 0, max_steps=6, eval_every=1, diverge_factor=math.inf)
    assert [loss for _, loss in no_warmup.losses][2] != pytest.approx(expected[2], rel=1e-6)


def test_divergence_counts_fresh_seeds_at_the_start_and_followed_settings(payoff):
    """A start LR far past the stability edge diverges on every fresh seed; a small followed LR on none."""
    from dataclasses import replace

    problem = PROBLEMS["bc_mlp"]
    cfg = replace(payoff.PayoffConfig(), divergence_seeds=2)
    counts = payoff.divergence(problem, problem.data(), cfg, 32, 50.0, {"batch_size": 64, "learning_rate": 0.5})
    assert counts[:3] == (2, 0, 2) and 0 < counts[3] < 20_000


@pytest.mark.parametrize("name, momentum", [("sgd", 0.0), ("momentum", 0.9)])
def test_the_measuring_fit_trains_with_the_problems_optimizer(name, momentum):
    """The recommendation reads the optimizer off the fit it measured: the momentum problem must measure with
    momentum (before, its measuring fit ran plain SGD, and the plain-SGD rules sent batch 512 to 48)."""
    import torch

    from tests.helpers import Classifier, mlp

    optimizer = Classifier(mlp(), lr=0.1, optimizer=name).configure_optimizers()
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.param_groups[0]["momentum"] == momentum
    with pytest.raises(ValueError, match="optimizer must be"):
        Classifier(mlp(), optimizer="lion").configure_optimizers()
