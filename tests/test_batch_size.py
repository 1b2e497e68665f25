"""batch_size_of: the leading dim most tensors share, None when it can't be told (never a guess); first_half_copied."""

import collections
from dataclasses import dataclass

import torch

from gns_callback.batch_size import batch_fingerprint, batch_size_of, first_half_copied


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


def test_first_half_copied_copies_rows_of_every_batch_tensor_and_keeps_the_rest():
    x, y, meta = torch.arange(12.0).reshape(6, 2), torch.arange(6), torch.ones(3)
    Named = collections.namedtuple("Named", "x y")
    batch = {"meta": meta, "inputs": [x, Named(x, y)], "name": "digits"}
    copied, changed = first_half_copied(batch, 6)
    assert changed
    assert torch.equal(copied["inputs"][0][3:], x[:3]) and torch.equal(copied["inputs"][0][:3], x[:3])
    assert isinstance(copied["inputs"][1], Named) and torch.equal(copied["inputs"][1].y, torch.tensor([0, 1, 2] * 2))
    assert copied["meta"] is meta and copied["name"] == "digits"
    assert torch.equal(x, torch.arange(12.0).reshape(6, 2))  # the batch itself is not changed


def test_first_half_copied_from_the_first_row_fills_the_second_half_with_row_0():
    """The second copy of the per-example check: a statistic of the batch the halves' copy left as it was moves."""
    y = torch.arange(7)
    copied, changed = first_half_copied((y, y * 2), 7, from_first_row=True)
    assert changed and torch.equal(copied[0], torch.tensor([0, 1, 2, 0, 0, 0, 6])) and torch.equal(copied[1],
                                                                                                 2 * copied[0])


def test_first_half_copied_with_an_odd_batch_keeps_the_last_row_and_says_when_nothing_matched():
    y = torch.arange(5)
    copied, changed = first_half_copied(Pair(y, y), 5)
    assert changed and torch.equal(copied.x, torch.tensor([0, 1, 0, 1, 4]))
    assert not first_half_copied((torch.ones(3),), 5)[1]


class Encoding(collections.UserDict):
    """Like Hugging Face's ``BatchEncoding``/``BatchFeature``: a ``UserDict`` with attributes of its own."""

    def __init__(self, data=None, n_sequences=1):
        super().__init__(data)
        self.n_sequences = n_sequences


class SharedStorage(collections.abc.MutableMapping):
    """A mapping whose shallow copy shares its storage: setting an item on the copy would change the original."""

    def __init__(self, data):
        self.data = data

    def __getitem__(self, key):
        return self.data[key]

    def __setitem__(self, key, item):
        self.data[key] = item

    def __delitem__(self, key):
        del self.data[key]

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)


def test_first_half_copied_rebuilds_every_kind_of_mapping_without_touching_the_batch():
    x = torch.arange(6.0)
    for batch in (Encoding({"pixel_values": x, "name": "a"}, n_sequences=2),
                  collections.defaultdict(list, {"pixel_values": x}), collections.OrderedDict(pixel_values=x)):
        copied, changed = first_half_copied(batch, 6)
        assert changed and type(copied) is type(batch) and copied is not batch
        assert torch.equal(copied["pixel_values"], torch.tensor([0.0, 1, 2, 0, 1, 2]))
        assert batch["pixel_values"] is x  # the batch itself is not changed
    assert first_half_copied(collections.defaultdict(list, {"x": x}), 6)[0].default_factory is list
    assert first_half_copied(Encoding({"pixel_values": x}, n_sequences=2), 6)[0].n_sequences == 2


def test_a_mapping_that_cannot_be_rebuilt_is_left_as_it_was():
    import types

    x = torch.arange(6.0)
    shared = SharedStorage({"pixel_values": x})
    for batch in (shared, types.MappingProxyType({"pixel_values": x})):
        copied, changed = first_half_copied(batch, 6)
        assert copied is batch and not changed and batch["pixel_values"] is x
    assert shared.data == {"pixel_values": x}


class Spans(tuple):
    """A tuple type with named fields whose constructor takes one argument, not one per field."""

    _fields = ("x", "y")

    def __new__(cls, pair):
        return super().__new__(cls, pair)


def test_a_batch_that_cannot_be_rebuilt_comes_back_whole_instead_of_raising():
    batch = Spans((torch.arange(6.0), torch.arange(6)))
    copied, changed = first_half_copied(batch, 6)
    assert copied is batch and not changed


def test_a_batch_fingerprint_is_shared_by_copies_only():
    """Copies of a batch share it (the data-parallel ranks' first batches are compared by it); other examples,
    the same examples in another order, or another label differ; a batch without tensors reads zeros."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    batch = {"x": x, "y": y, "ids": [torch.arange(32)]}
    same = {"x": x.clone(), "y": y.clone(), "ids": [torch.arange(32)]}
    assert torch.equal(batch_fingerprint(batch), batch_fingerprint(same))
    rows = torch.randperm(32, generator=g)
    for other in ({**batch, "x": torch.randn(32, 64, generator=g)}, {**batch, "x": x[rows], "y": y[rows]},
                  {**batch, "y": torch.where(torch.arange(32) == 5, (y + 1) % 10, y)}):
        assert not torch.equal(batch_fingerprint(batch), batch_fingerprint(other))
    assert batch_fingerprint(["raw", "strings"]).tolist() == [0.0, 0.0, 0.0]
    assert batch_fingerprint(torch.ones(5000, 3)).dtype == torch.float64


def test_a_list_of_one_tensor_per_example_counts_once_for_its_length():
    # collate_fn=lambda b: tuple(zip(*b)) over sequences padded in the model: 32 examples of 5-9 tokens
    tokens = tuple(torch.zeros(5 + i % 5, dtype=torch.long) for i in range(32))
    assert batch_size_of((tokens, tuple(torch.zeros(len(t), dtype=torch.long) for t in tokens))) == 32
    assert batch_size_of((tokens, tuple(torch.tensor(i) for i in range(32)))) == 32  # one label each
    assert batch_size_of({"tokens": list(tokens), "labels": torch.zeros(32, dtype=torch.long)}) == 32


def test_a_list_of_equal_tensors_whose_length_nothing_else_holds_is_not_guessed():
    # 32 sequences all cut to 16 tokens: 16 examples of 32 tokens, or 32 of 16; before, 16 (64 votes against none)
    tokens = tuple(torch.zeros(16, dtype=torch.long) for _ in range(32))
    assert batch_size_of((tokens, tokens)) is None
    assert batch_size_of((tokens, torch.zeros(32, dtype=torch.long))) == 32  # the labels hold the list's length


def test_lists_of_fields_still_vote_by_their_dim_0():
    x, y = torch.zeros(16, 3, 8, 8), torch.zeros(16, dtype=torch.long)
    crops = [x, x, x[:, :, :4, :4], x[:, :, :4, :4]]  # multi-crop views of one batch
    assert batch_size_of((crops, y)) == 16
    flat, offsets = torch.zeros(90, dtype=torch.long), torch.zeros(16, dtype=torch.long)
    assert batch_size_of((flat, offsets, y)) == 16  # the batch's own items are fields, never examples
    assert batch_size_of(((flat, offsets, offsets), y)) == 16  # the rest of the batch holds their common dim 0
