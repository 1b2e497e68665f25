from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import embedding_sq_norms


def _check(module: nn.Embedding, tokens: torch.Tensor, reference_sq_norms) -> torch.Tensor:
    weights = torch.randn_like(module(tokens))
    got = embedding_sq_norms(module, tokens, weights)
    assert got.shape == (tokens.shape[0],)
    torch.testing.assert_close(got, reference_sq_norms(module, tokens, weights), rtol=1e-4, atol=1e-10)
    return got


def test_repeated_tokens_within_an_example(reference_sq_norms) -> None:
    module = nn.Embedding(10, 4).double()
    tokens = torch.tensor([[1, 1, 1, 2], [3, 4, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
    _check(module, tokens, reference_sq_norms)


@pytest.mark.parametrize(("batch", "seq_len", "vocab"), [(4, 12, 3), (3, 7, 50), (2, 1, 5)])
def test_random_tokens(batch: int, seq_len: int, vocab: int, reference_sq_norms) -> None:
    module = nn.Embedding(vocab, 5).double()
    _check(module, torch.randint(vocab, (batch, seq_len)), reference_sq_norms)


@pytest.mark.parametrize("padding_idx", [0, 2, -1])
def test_padding_idx_row_gets_no_gradient(padding_idx: int, reference_sq_norms) -> None:
    module = nn.Embedding(4, 3, padding_idx=padding_idx).double()
    tokens = torch.tensor([[0, 2, 2, 3, 1], [3, 3, 3, 3, 3], [2, 2, 2, 2, 2]])
    got = _check(module, tokens, reference_sq_norms)
    if module.padding_idx == 2:
        assert got[2] == 0


@pytest.mark.parametrize("shape", [(5,), (3, 2, 4)])
def test_other_input_ranks(shape: tuple[int, ...], reference_sq_norms) -> None:
    module = nn.Embedding(6, 3).double()
    _check(module, torch.randint(6, shape), reference_sq_norms)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        (dict(max_norm=1.0), "max_norm"),
        (dict(sparse=True), "sparse"),
        (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
    ],
)
def test_unsupported_options_raise(option: dict, match: str) -> None:
    module = nn.Embedding(5, 3, **option)
    with pytest.raises(ValueError, match=match):
        embedding_sq_norms(module, torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 3, 3))


def test_frozen_weight_gives_zeros() -> None:
    module = nn.Embedding(5, 3)
    module.weight.requires_grad_(False)
    got = embedding_sq_norms(module, torch.zeros(2, 3, dtype=torch.long), torch.randn(2, 3, 3))
    assert torch.equal(got, torch.zeros(2))


def test_a_position_table_indexed_by_arange_is_recognised() -> None:
    from gns_callback.per_example.embedding import shared_table_reason

    assert "arange" in shared_table_reason(torch.arange(8))  # nanoGPT: wpe(torch.arange(T))
    assert "arange" in shared_table_reason(torch.arange(8).unsqueeze(0))  # position_ids of shape (1, T)
    assert shared_table_reason(torch.arange(8).expand(3, 8)) is None  # a batch dimension: per-example rows
    assert shared_table_reason(torch.tensor([3, 1, 4, 1, 5])) is None  # one token per example
    assert shared_table_reason(torch.tensor([0])) is None


def test_indices_with_no_dim_of_the_batch_s_size_are_a_shared_table() -> None:
    """T5's relative-position buckets, an (L, L) matrix: with the batch's size known, no dim of it holds the
    examples. Token indices batch first or sequence first do, and one token per example does."""
    from gns_callback.per_example.embedding import shared_table_reason

    buckets = torch.randint(0, 8, (10, 10))
    assert "no dim of the batch's 6 examples" in shared_table_reason(buckets, batch_size=6)
    assert shared_table_reason(buckets) is None  # the batch's size unknown: not told
    assert shared_table_reason(torch.randint(0, 8, (6, 10)), batch_size=6) is None
    assert shared_table_reason(torch.randint(0, 8, (10, 6)), batch_size=6) is None
    assert shared_table_reason(torch.tensor([3, 1, 4, 1, 5, 9]), batch_size=6) is None


def test_a_square_matrix_constant_along_its_diagonals_is_a_shared_table_at_any_batch_size() -> None:
    """T5's buckets of the distance j − i where L equals the batch's size; a batch of L random sequences of L tokens is
    not, nor is a constant matrix."""
    from gns_callback.per_example.embedding import shared_table_reason

    pos = torch.arange(12)
    buckets = (pos[None, :] - pos[:, None]).clamp(-3, 4) + 3
    assert "diagonals" in shared_table_reason(buckets, batch_size=12)
    assert "diagonals" in shared_table_reason(buckets)
    assert shared_table_reason(torch.randint(0, 17, (12, 12)), batch_size=12) is None
    assert shared_table_reason(torch.full((12, 12), 3), batch_size=12) is None
