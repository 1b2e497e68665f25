"""The probe's batches (:mod:`gns_callback.probe.batches`): the examples are counted as the estimate counts them,
so that a metadata tensor in front of the data is not what gets tiled to each trial size."""

import pytest
import torch
import torch.nn.functional as F

from gns_callback.probe import probe_micro_batch, resize_batch
from gns_callback.probe.batches import batch_size_of
from tests.helpers import mlp

META, X, Y = torch.zeros(3), torch.randn(32, 64), torch.randint(0, 10, (32,))


def test_the_examples_are_the_dim_0_most_tensors_share():
    assert batch_size_of((META, X, Y)) == 32  # the first tensor's dim 0 read 3
    tiled = resize_batch((META, X, Y), 80)
    assert [tuple(t.shape) for t in tiled] == [(3,), (80, 64), (80,)]


def test_a_batch_whose_size_cannot_be_told_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="can't tell how many examples.*Pass batch_size"):
        batch_size_of((X, META))


def probe(batch, step, **kwargs):
    net = mlp()
    return probe_micro_batch(net, torch.optim.SGD(net.parameters(), lr=0.1), batch, lambda b: step(net, b),
                             memory_budget_bytes=8_000_000, throughput_sizes=[32], timed_steps=1, progress_bar=False,
                             **kwargs)


def test_metadata_in_front_of_the_data_is_probed_as_the_data_alone():
    """Before, ``(meta_3vec, x, y)`` tiled only the metadata: 0 bytes per example, and the largest size allowed."""
    plain = probe((X, Y), lambda net, b: F.cross_entropy(net(b[0]), b[1]))
    meta = probe((META, X, Y), lambda net, b: F.cross_entropy(net(b[1]), b[2]))
    assert plain.bytes_per_sample > 0
    assert meta.bytes_per_sample == plain.bytes_per_sample and meta.max_micro_batch == plain.max_micro_batch


def test_a_tie_is_probed_when_the_batch_size_is_given():
    def step(net, batch):
        return F.cross_entropy(net(batch[0]), (batch[0][:, 0] > 0).long())  # labels from the inputs

    with pytest.raises(ValueError, match="Pass batch_size"):
        probe((X, META), step)
    assert probe((X, META), step, batch_size=32).bytes_per_sample > 0
