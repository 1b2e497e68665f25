"""batch_size_of: the leading dim most tensors share, None when it can't be told (never a guess)."""

from dataclasses import dataclass

import torch

from gns_callback.batch_size import batch_size_of


@dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor


def test_majority_over_any_nesting():
    x, y, meta = torch.zeros(16, 64), torch.zeros(16, dtype=torch.long), torch.zeros(3)
    assert batch_size_of((meta, x, y)) == 16  # Lightning's first-tensor rule reads 3 here
    assert batch_size_of({"meta": meta, "inputs": [x, {"y": y}]}) == 16
    assert batch_size_of(Pair(x, y)) == 16
    assert batch_size_of(x) == 16


def test_unknown_instead_of_a_guess():
    assert batch_size_of(["a string", "another"]) is None  # raw strings, tokenized in training_step
    assert batch_size_of({"text": ["a"], "id": torch.tensor(3)}) is None  # 0-dim tensors have no batch dim
    assert batch_size_of((torch.zeros(3), torch.zeros(16, 64))) is None  # one tensor each: a tie
    tokens, flat_labels = torch.zeros(8, 32, dtype=torch.long), torch.zeros(8 * 32, dtype=torch.long)
    assert batch_size_of((tokens, flat_labels)) is None
