"""Batches drawn without replacement (:mod:`gns_callback.sampling`): the correction makes the estimates exactly
unbiased, checked over every batch a small population allows; which torch samplers draw that way; and where an
example's draws may vary, the interval's upper end that also holds noise drawn afresh."""

import itertools
import math

import pytest
import torch
from torch import nn
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                              SequentialSampler, Subset, SubsetRandomSampler, TensorDataset, WeightedRandomSampler)

from gns_callback.estimators import grad_sq_norm_estimate, trace_sigma_estimate
from gns_callback.sampling import (NOT_SHUFFLED, WEIGHTED_ORDER, draws_may_vary, population_of, unknown_draws,
                                   varying_draws_high, without_replacement)

N = 8


@pytest.fixture(scope="module")
def gradients():
    """Eight per-example gradients with a mean well away from zero, and their exact ``(tr Σ, |G|²)``."""
    g = torch.randn(N, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.7
    mean = g.mean(0)
    return g, float((g - mean).pow(2).sum(1).mean()), float(mean.pow(2).sum())


def expected_estimates(g, batch, micro):
    """The independent-draw estimates ``(x, y)`` averaged over every ordered batch of ``batch`` distinct examples
    (a shuffled epoch's), split in order into micro-batches of ``micro`` (1: per-example norms)."""
    xs, ys = [], []
    for chosen in itertools.permutations(range(N), batch):
        rows = g[list(chosen)]
        small = rows.reshape(batch // micro, micro, -1).mean(1).pow(2).sum(1).mean()
        big = rows.mean(0).pow(2).sum()
        xs.append(float(trace_sigma_estimate(small, big, micro, batch)))
        ys.append(float(grad_sq_norm_estimate(small, big, micro, batch)))
    return sum(xs) / len(xs), sum(ys) / len(ys)


@pytest.mark.parametrize("batch, micro", [(4, 1), (3, 1), (4, 2), (6, 3)])
def test_the_correction_is_exactly_unbiased_over_every_batch(gradients, batch, micro):
    g, trace, grad_sq = gradients
    x, y = expected_estimates(g, batch, micro)
    assert y < grad_sq * 0.99  # uncorrected, |G|² reads low: by tr Σ/(N−1) in expectation
    assert without_replacement(x, y, N) == pytest.approx((trace, grad_sq), rel=1e-12)
    assert without_replacement(x, y, None) == (x, y)


def test_samplers_say_how_they_draw():
    data = range(10)
    assert population_of(RandomSampler(data)) == (10, None)
    assert population_of(RandomSampler(data, replacement=True)) == (None, None)
    assert population_of(SubsetRandomSampler([1, 3, 5])) == (3, None)
    assert population_of(DistributedSampler(data, num_replicas=2, rank=0)) == (10, None)
    assert population_of(DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)) == (None, NOT_SHUFFLED)
    assert population_of(SequentialSampler(data)) == (None, NOT_SHUFFLED)
    assert population_of(SequentialSampler(data), in_random_order=True) == (len(data), None)
    assert population_of(DistributedSampler(data, num_replicas=2, rank=0, shuffle=False), in_random_order=True) == (
        len(data), None)
    assert population_of(WeightedRandomSampler([1.0] * 10, 10)) == (None, None)
    assert population_of(WeightedRandomSampler([1.0] * 10, 4, replacement=False)) == (10, None)
    assert population_of(WeightedRandomSampler([1.0] * 10, 4, replacement=False), ranks=2) == (None, None)
    assert population_of(None) == (None, None)
    assert population_of(RandomSampler(data), ranks=2) == (None, None)  # each rank draws on its own


def test_the_meter_reads_the_population_off_a_loader():
    from torch.utils.data import DataLoader, TensorDataset

    from gns_callback import GradientNoiseScaleMeter

    data = TensorDataset(torch.zeros(30, 2), torch.zeros(30))
    model = torch.nn.Linear(2, 1)
    assert GradientNoiseScaleMeter(model, population=DataLoader(data, batch_size=4, shuffle=True)).population == 30
    with pytest.raises(ValueError, match=r"population: the training DataLoader does not shuffle.*shuffle=True.*len"):
        GradientNoiseScaleMeter(model, population=DataLoader(data, batch_size=4))
    assert GradientNoiseScaleMeter(model, population=DataLoader(data, batch_size=None)).population is None
    with pytest.raises(ValueError, match="population"):
        GradientNoiseScaleMeter(model, population="30")


def test_the_varying_draws_upper_end_is_the_uncorrected_ratio():
    """``x/y`` from the corrected ratio ``x(N − 1)/(N·y + x)``, for any pair; infinite once the corrected ratio
    reaches ``N − 1``; unchanged without a population."""
    population = 178
    for x, y in [(3.0, 0.05), (0.7, 0.2), (12.0, 0.01)]:
        trace, grad_sq = without_replacement(x, y, population)
        assert varying_draws_high(trace / grad_sq, population) == pytest.approx(x / y, rel=1e-12)
    assert varying_draws_high(177.0, population) == math.inf
    assert varying_draws_high(math.inf, population) == math.inf
    assert varying_draws_high(40.0, None) == 40.0


class Jittered(torch.utils.data.Dataset):
    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + torch.randn_like(self.x[i])


def test_draws_shown_fixed_only_for_tensors_batched_as_they_are_under_a_model_without_dropout():
    x = torch.randn(10, 3)
    tensors = TensorDataset(x, torch.zeros(10))
    mlp = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert draws_may_vary(DataLoader(tensors, batch_size=2, shuffle=True), mlp) is None
    assert draws_may_vary(DataLoader(Subset(tensors, range(6)), batch_size=2, shuffle=True), mlp) is None
    assert "Jittered" in draws_may_vary(DataLoader(Jittered(x), batch_size=2, shuffle=True), mlp)
    assert "collate" in draws_may_vary(DataLoader(tensors, batch_size=2, collate_fn=lambda rows: rows), mlp)
    assert "can't be seen" in draws_may_vary(None, mlp)
    assert "'1'" in draws_may_vary(DataLoader(tensors), nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1)))
    assert draws_may_vary(DataLoader(tensors), nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.0))) is None
    assert "'attn'" in draws_may_vary(DataLoader(tensors), nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2, 0.1)}))


def test_a_loader_left_out_of_population_is_found_in_the_loops_scope():
    """:func:`unstated_population`: a loader drawing without replacement (one shuffled order for all ranks, under
    several); not one that draws with replacement, reads in order, or shuffles on each rank apart from the others."""
    from gns_callback.sampling import unstated_population

    data = TensorDataset(torch.zeros(30, 2), torch.zeros(30))
    shuffled = DataLoader(data, batch_size=4, shuffle=True)
    sharded = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    replaced = DataLoader(data, batch_size=4, sampler=RandomSampler(data, replacement=True))
    population, why = unstated_population([("x", 3), ("train", shuffled)])
    assert population == 30 and "population=train" in why
    assert unstated_population([("train", shuffled)], ranks=2) is None
    assert unstated_population([("train", sharded)], ranks=2)[0] == 30
    assert unstated_population([("r", replaced), ("s", DataLoader(data, batch_size=4))]) is None


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(4))


class Grouped(BatchSampler):
    """A batch sampler of one's own: the same batches whatever it is given."""

    def __iter__(self):
        return iter([[0, 1], [2, 3]])


def test_batches_a_loader_decides_itself_are_not_taken_for_random_draws():
    """A ``batch_sampler`` of its own (a subclass of torch's too) or an ``IterableDataset`` decides which examples
    share a batch: :func:`unknown_draws` names it; torch's own ``BatchSampler`` over any sampler, and ready-made
    batches (``batch_size=None``), are left to :func:`population_of`."""
    data = TensorDataset(torch.zeros(4, 1))
    grouped = unknown_draws(DataLoader(data, batch_sampler=Grouped(SequentialSampler(data), 2, False)))
    assert "batch_sampler of its own (Grouped)" in grouped
    assert "IterableDataset (Stream)" in unknown_draws(DataLoader(Stream(), batch_size=2))
    assert unknown_draws(DataLoader(data, batch_size=2, shuffle=True)) is None
    assert unknown_draws(DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 4, 4))) is None
    assert unknown_draws(DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 2, False))) is None
    assert unknown_draws(DataLoader(data, batch_size=None)) is None
    assert unknown_draws([torch.zeros(2, 1)]) is None


def test_weighted_draws_without_replacement_keep_the_upper_end_of_independent_draws():
    """Its order biased by the weights, a ``WeightedRandomSampler(replacement=False)``'s batches lie between
    independent and shuffled draws: corrected for its examples, with the uncorrected upper end kept."""
    data = TensorDataset(torch.zeros(10, 1))
    weighted = DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 10, replacement=False))
    assert draws_may_vary(weighted) == WEIGHTED_ORDER
    assert draws_may_vary(DataLoader(data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 10, 10))) is None
