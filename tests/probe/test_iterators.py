"""Iterators and generators a module keeps in its attributes, across passes aside from the run
(:mod:`gns_callback.probe.iterators`, the generators in :class:`gns_callback.probe.state.RNGState`): the run draws
the same values as without the passes, and gets its original objects back."""

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gns_callback.probe import probe_micro_batch, preserved_state
from gns_callback.probe.iterators import ReplayIterator


def counting(limit=None):
    count = 0
    while limit is None or count < limit:
        yield count
        count += 1


class Keeper(nn.Module):
    """A model with an iterator over an auxiliary loader, a generator of values in a submodule, and random
    generators of its own."""

    def __init__(self, limit=None):
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.aux = iter(DataLoader(TensorDataset(torch.arange(800.0).view(400, 2)), batch_size=2))
        self.body.values = counting(limit)
        self.gen = torch.Generator().manual_seed(0)
        self.rng = np.random.default_rng(0)
        self.py = random.Random(0)

    def draw(self):
        """What a step would take from each of them."""
        return (next(self.aux)[0].sum().item(), next(self.body.values), torch.rand(1, generator=self.gen).item(),
                float(self.rng.random()), self.py.random())


def test_the_run_draws_what_it_would_have_drawn_without_the_passes():
    untouched, model = Keeper(), Keeper()
    originals = model.aux, model.body.values
    with preserved_state(model, []) as state:
        first = [model.draw() for _ in range(3)]
        state.restore()
        assert [model.draw() for _ in range(2)] == first[:2]  # restoring rewinds
    assert [model.draw() for _ in range(6)] == [untouched.draw() for _ in range(6)]
    assert (model.aux, model.body.values) == originals  # handed back once the recorded values are drawn
    assert not state.not_restored


def test_an_iterator_not_drawn_from_is_put_back_at_once():
    model = Keeper()
    original = model.aux
    with preserved_state(model, []):
        assert isinstance(model.aux, ReplayIterator)
        assert model.aux._num_yielded == 0  # attributes are the original's
    assert model.aux is original


def test_an_iterator_the_passes_exhaust_ends_where_it_would_have():
    model = Keeper(limit=2)
    with preserved_state(model, []):
        assert [next(model.body.values) for _ in range(2)] == [0, 1]
        try:
            next(model.body.values)
        except StopIteration:
            pass
    assert list(model.body.values) == [0, 1]


def test_a_probe_leaves_an_auxiliary_iterator_as_the_run_would_use_it():
    """The probe's trials run the step, which draws from the iterator; the run then draws the same batches."""
    untouched, model = Keeper(), Keeper()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(batch):
        return F.mse_loss(model.body(batch[0]), batch[1]) + next(model.aux)[0].mean() * 0.0

    batch = (torch.randn(4, 4), torch.randn(4, 3))
    probe_micro_batch(model, optimizer, batch, step, memory_budget_bytes=100_000, timed_steps=1,
                      timing_budget_s=0.05, progress_bar=False)
    assert [model.draw() for _ in range(5)] == [untouched.draw() for _ in range(5)]


class Helper:
    """An augmenter object holding a generator, as a module may keep one."""

    def __init__(self):
        self.rng = np.random.default_rng(1)


def noisy():
    """An iterator whose values draw from the global streams."""
    while True:
        yield random.random() + torch.rand(1).item()


class Nested(nn.Module):
    """Generators inside a helper object and a dict, an iterator drawing from the global streams, and an iterator
    over a shuffled loader with a generator of its own, re-made when it ends (two batches a pass over it)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(2, 2)
        self.helper = Helper()
        self.gens = {"noise": torch.Generator().manual_seed(2)}
        self.noise = noisy()
        self.loader = DataLoader(TensorDataset(torch.arange(4.0)), batch_size=2, shuffle=True,
                                 generator=torch.Generator().manual_seed(3))
        self.batches = iter(self.loader)

    def draw(self):
        try:
            batch = next(self.batches)[0].tolist()
        except StopIteration:
            self.batches = iter(self.loader)
            batch = next(self.batches)[0].tolist()
        return (float(self.helper.rng.random()), torch.rand(1, generator=self.gens["noise"]).item(), next(self.noise),
                batch)


def test_nested_generators_global_draws_and_an_iterator_ended_in_a_pass_leave_the_run_as_it_was():
    """Before, a generator in a helper object or a dict was never put back; the global draws an iterator made in a
    pass were rewound, so the run's streams fell behind; and an iterator a pass ran to its end (a RandomSampler
    draws once more as it ends) left the loader's generator one order behind: the next epoch's order differed."""
    runs = []
    for aside in (False, True):
        random.seed(0)
        torch.manual_seed(0)
        model = Nested()
        draws = [model.draw(), model.draw()]
        if aside:
            with preserved_state(model, []) as state:
                [model.draw() for _ in range(5)]
                state.restore()
                [model.draw() for _ in range(3)]
        draws += [model.draw() for _ in range(6)]
        runs.append((draws, torch.rand(1).item(), random.random()))
    assert runs[0] == runs[1]


def test_two_sets_of_passes_in_a_row_leave_the_run_as_it_was():
    """The per-example check and then the loss's reduction run their passes in two contexts, one after the other,
    before the run draws again. Before, the second set drew the first set's recorded value back, the original came
    back in its place, and its next pass drew from the original itself: the run skipped a value."""
    untouched, model = Keeper(), Keeper()
    with preserved_state(model, []) as state:
        first = model.draw()
        state.restore()
        assert model.draw() == first
    with preserved_state(model, []) as state:
        assert model.draw() == first  # the value the run has not drawn back yet comes first
        state.restore()
        assert [model.draw() for _ in range(2)][0] == first
    assert [model.draw() for _ in range(5)] == [untouched.draw() for _ in range(5)]
