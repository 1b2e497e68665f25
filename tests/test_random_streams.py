"""Which random streams a step draws from (:mod:`gns_callback.random_streams`): each kind of stream is seen to move
when drawn from, and only then, and reading the states changes nothing."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gns_callback.random_streams import (RandomDrawWatch, StepDrawWatch, caller_frames, moved, scope_generators,
                                         stream_states)


class Holder(nn.Module):
    """A model that keeps generators of its own, in a submodule too."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 3)
        self.inner.gen = torch.Generator().manual_seed(0)
        self.rng = np.random.default_rng(0)
        self.legacy = np.random.RandomState(0)
        self.py = random.Random(0)


DRAWS = {
    "torch": lambda m: torch.randn(3),
    "numpy": lambda m: np.random.rand(),
    "random": lambda m: random.random(),
    "inner.gen": lambda m: torch.rand(2, generator=m.inner.gen),
    "rng": lambda m: m.rng.normal(),
    "legacy": lambda m: m.legacy.rand(),
    "py": lambda m: m.py.random(),
}


@pytest.mark.parametrize("stream", sorted(DRAWS))
def test_a_draw_moves_its_stream_and_no_other(stream):
    model = Holder()
    watch = RandomDrawWatch(model)
    watch.start()
    DRAWS[stream](model)
    assert watch.stop() == [stream]


def test_dropout_by_function_is_a_draw_and_a_deterministic_step_is_not():
    model = nn.Linear(4, 2)
    x = torch.ones(8, 4)
    watch = RandomDrawWatch(model)
    watch.start()
    model(x).sum().backward()
    assert watch.stop() == []
    watch.start()
    F.dropout(model(x), 0.1, training=True).sum()
    assert watch.stop() == ["torch"]
    watch.start()
    F.dropout(model(x), 0.1, training=False).sum()  # eval: no mask drawn
    assert watch.stop() == []


def test_reading_the_states_draws_nothing():
    """The streams after reading are where they were: the next draws are the same as without the readings."""
    model = Holder()
    torch.manual_seed(3)
    expected = torch.rand(4), model.inner.gen.get_state()
    torch.manual_seed(3)
    stream_states(model)
    stream_states(model)
    assert torch.equal(torch.rand(4), expected[0]) and torch.equal(model.inner.gen.get_state(), expected[1])


def test_not_started_reads_none_and_each_start_is_a_new_window():
    watch = RandomDrawWatch()
    assert watch.stop() is None
    watch.start()
    torch.rand(1)
    assert watch.stop() == ["torch"]
    assert watch.stop() is None
    watch.start()
    assert watch.stop() == []


def test_a_generator_only_in_one_reading_counts_as_moved():
    assert moved({"torch": b"a"}, {"torch": b"a", "gen": b"b"}) == ["gen"]
    assert moved({"torch": b"a", "gen": b"b"}, {"torch": b"a", "gen": b"b"}) == []


def test_between_steps_only_a_draw_in_every_window_counts():
    """A sampler draws an epoch's order once per epoch: one window with a draw is not the step's own."""
    once = StepDrawWatch()
    assert once.tick() is None  # the first reading
    torch.rand(1)  # an epoch starts
    assert once.tick() is None
    assert once.tick() == []
    every = StepDrawWatch(windows=3)
    results = []
    for _ in range(4):
        results.append(every.tick())
        np.random.rand()
    assert results == [None, None, None, ["numpy"]]


class Augmenter:
    def __init__(self):
        self.rng = np.random.default_rng(0)


def test_the_generators_a_loop_keeps_in_its_scope_are_found():
    """Locals, objects and dicts they hold (two levels down), and globals directly; modules are not walked."""
    own = torch.Generator().manual_seed(0)
    helpers = {"augment": Augmenter()}
    found = dict(scope_generators(caller_frames(1, above=0)))
    assert found["loop:own"] is own and found["loop:helpers['augment'].rng"] is helpers["augment"].rng
    assert set(found) == {"loop:own", "loop:helpers['augment'].rng", "loop:GLOBAL_RNG"}


GLOBAL_RNG = random.Random(0)


def test_a_global_generator_of_the_loops_module_is_found():
    found = dict(scope_generators(caller_frames(1, above=0)))
    assert found["loop:GLOBAL_RNG"] is GLOBAL_RNG


class Counted:
    """Counts the looks at its attributes."""

    looks = 0

    def __getattribute__(self, name):
        if name == "__dict__":
            type(self).looks += 1
        return object.__getattribute__(self, name)


def test_a_long_list_in_the_loops_scope_is_looked_at_in_its_first_entries_only():
    """A data set held as a list of a million entries took 3.5 s a step to walk, on each of the first steps."""
    rows = [torch.Generator(), *(Counted() for _ in range(10_000))]
    found = dict(scope_generators(caller_frames(1, above=0)))
    assert found["loop:rows[0]"] is rows[0]
    assert Counted.looks <= 2 * 256  # hasattr and vars, on the first entries
