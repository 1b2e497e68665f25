"""``nn.EmbeddingBag``, one example per bag, against one backward pass per bag."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.embedding_bag import embedding_bag_sq_norms

VOCAB, DIM = 9, 4
BAGS = [[1, 3, 3, 0], [2], [], [0, 0], [5, 6, 5, 5, 1]]  # repeated tokens, an empty bag, padding only (index 0)


def flat_bags() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.tensor([t for bag in BAGS for t in bag])
    offsets = torch.tensor([0] + [len(bag) for bag in BAGS][:-1]).cumsum(0)
    return tokens, offsets


def per_bag_reference(module: nn.EmbeddingBag, weights: torch.Tensor, per_sample: torch.Tensor | None) -> torch.Tensor:
    """``|∇W|²`` of ``(module(bag)·R_b).sum()`` for each bag alone."""
    norms, start = [], 0
    for b, bag in enumerate(BAGS):
        tokens = torch.tensor(bag, dtype=torch.long)
        sample = None if per_sample is None else per_sample[start:start + len(bag)]
        out = module(tokens, torch.tensor([0]), per_sample_weights=sample)
        (grad,) = torch.autograd.grad((out * weights[b]).sum(), [module.weight])
        norms.append(grad.square().sum())
        start += len(bag)
    return torch.stack(norms)


@pytest.mark.parametrize("mode, padding, weighted", [("sum", None, False), ("mean", None, False), ("mean", 0, False),
                                                     ("sum", 0, False), ("sum", None, True)])
def test_matches_one_backward_pass_per_bag(mode, padding, weighted) -> None:
    module = nn.EmbeddingBag(VOCAB, DIM, mode=mode, padding_idx=padding).double()
    tokens, offsets = flat_bags()
    per_sample = torch.rand(len(tokens), dtype=torch.float64) if weighted else None
    weights = torch.randn(len(BAGS), DIM, dtype=torch.float64)
    got = embedding_bag_sq_norms(module, tokens, offsets, per_sample, weights)
    torch.testing.assert_close(got, per_bag_reference(module, weights, per_sample))


@pytest.mark.parametrize("last_offset", [False, True])
def test_the_tracker_measures_bags_given_as_offsets_or_as_rows(last_offset) -> None:
    """A bag-of-words classifier: flat tokens with offsets (``include_last_offset`` either way), and a (B, L) input."""
    bag = nn.EmbeddingBag(VOCAB, DIM, mode="mean", include_last_offset=last_offset).double()
    head = nn.Linear(DIM, 3).double()
    tokens, offsets = flat_bags()
    if last_offset:
        offsets = torch.cat([offsets, torch.tensor([len(tokens)])])
    weights = torch.randn(len(BAGS), 3, dtype=torch.float64)
    model = nn.ModuleDict({"bag": bag, "head": head})
    with PerExampleNormTracker(model) as tracker:
        assert tracker.coverage_fraction() == 1.0
        (head(bag(tokens, offsets)) * weights).sum().backward()
        got = tracker.pop()
    expected = []
    for b, tokens_b in enumerate(BAGS):
        out = head(bag(torch.tensor(tokens_b, dtype=torch.long), torch.tensor([0, len(tokens_b)][: 1 + last_offset])))
        grads = torch.autograd.grad((out * weights[b]).sum(), list(model.parameters()), allow_unused=True)
        expected.append(sum(g.square().sum() for g in grads if g is not None))
    torch.testing.assert_close(got.double(), torch.stack(expected), rtol=1e-5, atol=0)

    rows = torch.tensor([[1, 3, 3], [2, 2, 7]])
    with PerExampleNormTracker(model) as tracker:
        head(bag(rows)).sum().backward()
        assert tracker.pop().shape == (2,)


def test_max_mode_is_left_out_with_the_reason() -> None:
    model = nn.ModuleDict({"bag": nn.EmbeddingBag(VOCAB, DIM, mode="max"), "head": nn.Linear(DIM, 3)})
    with PerExampleNormTracker(model) as tracker:
        assert "mode='max'" in tracker.excluded_reasons["bag.weight"]
