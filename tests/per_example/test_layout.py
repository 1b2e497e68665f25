"""Which dim of a layer's input holds the batch: every branch of ``batch_dim`` and the per-module position dims."""

import pytest
import torch
from torch import nn

from gns_callback.per_example.layout import (LayoutError, LayoutMemory, batch_dim, is_sequence_first,
                                             position_dims, unflattened)


@pytest.mark.parametrize(
    "shape, dims, expected, sequence_first, dim",
    [
        ((32, 8, 16), 2, 32, False, 0),  # batch-first sequence
        ((8, 32, 16), 2, 32, False, 1),  # (T, B, D)
        ((8, 32, 16), 2, 32, True, 1),
        ((32, 16), 1, 32, True, 0),  # (B, D) after pooling, in a sequence-first model
        ((32, 32, 16), 2, 32, False, 0),  # T == B: dim 0 by convention when nothing is sequence-first
        ((32, 8, 16), 2, None, False, 0),  # size unknown: dim 0
        ((8, 32, 16), 2, None, False, 0),  # (it is then checked across layers and at the step)
    ],
)
def test_batch_dim(shape, dims, expected, sequence_first, dim):
    assert batch_dim(shape, dims, expected, sequence_first) == dim


@pytest.mark.parametrize(
    "shape, dims, expected, sequence_first, match",
    [
        ((32, 32, 16), 2, 32, True, "both equal the batch size 32"),
        ((8, 4, 16), 2, 32, False, "neither dim 0 nor dim 1 holds the batch of 32"),
        ((24, 64), 1, 32, False, "learned table"),  # not a whole share of the batch: no chunk hint
        ((10, 64), 1, 32, False, "dim 0 does not hold the batch of 32 examples \\(the layer runs on something"),
        ((16, 64), 1, 32, False, "16 rows, 1/2 of the batch: the forward most likely runs the batch in chunks"),
        ((8, 4, 16), 2, 32, False, "1/4 of the batch: .* batch_size=8 and accumulate_grad_batches multiplied by 4"),
        ((32 * 8, 16), 1, 32, False, "dim 0 does not hold"),  # positions reshaped into rows
        ((8, 32, 16), 2, None, True, "size is unknown"),
    ],
)
def test_batch_dim_refuses_what_it_cannot_tell(shape, dims, expected, sequence_first, match):
    with pytest.raises(LayoutError, match=match):
        batch_dim(shape, dims, expected, sequence_first)


@pytest.mark.parametrize("sequence_first", [False, True])
@pytest.mark.parametrize("seen", [0, 1])
def test_where_both_dims_hold_the_batch_the_dim_seen_before_decides(seen, sequence_first):
    assert batch_dim((32, 32, 16), 2, 32, sequence_first, seen=seen) == seen
    assert batch_dim((8, 32, 16), 2, 32, sequence_first, seen=0) == 1  # the shape tells: it wins


def test_layout_memory_remembers_what_the_shapes_told_and_never_guesses_between_two():
    layer, other = nn.Linear(16, 2), nn.Linear(16, 2)
    square, t_first, b_first = torch.zeros(32, 32, 16), torch.zeros(8, 32, 16), torch.zeros(32, 8, 16)
    memory = LayoutMemory()
    with pytest.raises(LayoutError, match="both equal"):
        memory.batch_dim(layer, square, 32, True)  # nothing seen yet
    assert memory.batch_dim(layer, t_first, 32, True) == 1
    assert memory.batch_dim(layer, square, 32, True) == 1
    assert memory.batch_dim(layer, square, 32, False) == 1  # a hand-written (T, B, D) model too
    with pytest.raises(LayoutError, match="both equal"):
        memory.batch_dim(other, square, 32, True)  # per layer
    assert memory.batch_dim(layer, b_first, 32, True) == 0  # now seen both ways: no guess
    with pytest.raises(LayoutError, match="both equal"):
        memory.batch_dim(layer, square, 32, True)
    assert memory.batch_dim(layer, square, None, False) == 0  # size unknown: nothing remembered


def test_position_dims_per_layer_type():
    x3 = torch.zeros(8, 4, 6)
    assert position_dims(nn.Linear(6, 2), x3) == 2
    assert position_dims(nn.LayerNorm(6), x3) == 2
    assert position_dims(nn.LayerNorm((4, 6)), x3) == 1
    assert position_dims(nn.Embedding(5, 3), torch.zeros(8, 4, dtype=torch.long)) == 2
    assert position_dims(nn.Conv1d(8, 2, 3), x3) == 1  # channels first: the batch is dim 0 only
    assert position_dims(nn.GroupNorm(2, 4), x3) == 1


def test_sequence_first_modules_are_found():
    assert is_sequence_first(nn.Sequential(nn.Linear(2, 2), nn.TransformerEncoderLayer(8, 2)))
    assert is_sequence_first(nn.LSTM(2, 2))
    assert not is_sequence_first(nn.TransformerEncoderLayer(8, 2, batch_first=True))
    assert not is_sequence_first(nn.Linear(2, 2))


def _flat(source: tuple[int, ...], make) -> torch.Tensor:
    return make(torch.randn(source, requires_grad=True) * 1.0)


@pytest.mark.parametrize("layer, source, make, expected, found", [
    (nn.Linear(6, 4), (5, 3, 6), lambda h: h.view(15, 6), 5, (5, 3, 6)),
    (nn.Linear(6, 4), (5, 3, 6), lambda h: h.flatten(0, 1), 5, (5, 3, 6)),
    (nn.Linear(6, 4), (3, 5, 6), lambda h: h.reshape(-1, 6), 5, (3, 5, 6)),  # sequence-first: batch_dim reads dim 1
    (nn.Linear(6, 4), (5, 3, 2, 6), lambda h: h.reshape(-1, 6), 5, (5, 3, 2, 6)),
    (nn.LayerNorm(6), (5, 3, 6), lambda h: h.view(15, 6), 5, (5, 3, 6)),
    (nn.Linear(6, 4), (5, 3, 6), lambda h: h.view(15, 6), 15, None),  # dim 0 holds the batch as it is
    (nn.Linear(6, 4), (5, 3, 6), lambda h: h.view(15, 6), None, None),  # size unknown: no guess
    (nn.Linear(6, 4), (3, 2, 5, 6), lambda h: h.reshape(-1, 6), 5, None),  # the batch deeper than dim 1
    (nn.Linear(6, 4), (5, 3, 6), lambda h: h.transpose(1, 2).reshape(15, 6), 5, (5, 3, 6)),  # features as rows,
    # example by example: each example's rows are its own (:mod:`~gns_callback.per_example.window_rows`)
    (nn.Linear(6, 4), (5, 3, 6), lambda h: h.transpose(0, 1).reshape(15, 6), 5, (3, 5, 6)),  # position by position
    (nn.Linear(18, 4), (5, 3, 6), lambda h: h.view(5, 18), 5, None),  # already holds the batch
    (nn.Conv1d(3, 4, 1), (5, 3, 6), lambda h: h.view(15, 6).view(5, 3, 6), 5, None),  # channels-first: never
    (nn.Linear(6, 4), (5, 3, 6), lambda h: torch.tanh(nn.Linear(6, 6)(nn.LayerNorm(6)(h.view(15, 6)))), 5,
     (5, 3, 6)),  # through row-wise layers since
    (nn.Linear(6, 4), (5, 3, 6), lambda h: torch.nn.functional.layer_norm(h.view(15, 6), (15, 6)), 5, None),
    (nn.Linear(6, 4), (5, 3, 6), lambda h: h.view(15, 6).softmax(0), 5, None),  # mixes the rows
])
def test_unflattened(layer, source, make, expected, found):
    assert unflattened(layer, _flat(source, make), expected) == found


def test_a_flattened_input_with_no_history_is_not_unflattened():
    """Data flattened before the model (no autograd history) tells nothing about its rows."""
    assert unflattened(nn.Linear(6, 4), torch.randn(5, 3, 6).view(15, 6), 5) is None
