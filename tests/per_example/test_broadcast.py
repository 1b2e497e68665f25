"""Bare parameters broadcast over the batch (a ViT's class token and position table, a layer scale, a learned
offset): their per-example gradients read at the broadcast, against ``torch.func``; and the tracker, which
measures them from their first pass on where those gradients add up to theirs, and leaves them out otherwise."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from benchmarks.model_scan import ViTStyle
from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.broadcast import adds_up_to, batch_dim, example_grads, examples_dim, find_consumers

B, T, D = 5, 3, 4

#: (name, parameter shape, use of the parameter p on the examples' activations x (B, T, D)).
USES = [
    ("x + p", (1, T, D), lambda x, p: x + p),
    ("p + x, p broadcast by its rank", (D,), lambda x, p: p + x),
    ("x + α·p", (T, D), lambda x, p: torch.add(x, p, alpha=2.5)),
    ("x − α·p", (1, 1, D), lambda x, p: torch.sub(x, p, alpha=0.5)),
    ("p − x", (1, T, 1), lambda x, p: p - x),
    ("x ⊙ p (layer scale)", (D,), lambda x, p: x * p),
    ("p ⊙ x", (1, T, D), lambda x, p: p * x),
    ("in place x += p", (D,), lambda x, p: x.clone().add_(p)),
    ("in place x *= p (timm's LayerScale)", (D,), lambda x, p: x.clone().mul_(p)),
    ("p expanded and concatenated (class token)", (1, 1, D),
     lambda x, p: torch.cat([p.expand(x.shape[0], -1, -1), x], dim=1)),
    ("two uses of p", (1, T, D), lambda x, p: (x + p) * p),
    ("x ⊙ (1 + p.float()) (Gemma's RMSNorm)", (D,), lambda x, p: x * (1.0 + p.float())),
    ("x ⊙ p + x² ⊙ (1 − p) (RWKV's time mix)", (D,), lambda x, p: x * p + x * x * (1 - p)),
    ("F.layer_norm(x, (D,), p) (nanoGPT's LayerNorm)", (D,), lambda x, p: F.layer_norm(x, (D,), p)),
    ("F.layer_norm(x, (D,), None, p), a bias", (D,), lambda x, p: F.layer_norm(x, (D,), None, p)),
    ("F.layer_norm(x, (T, D), p) over two dims", (T, D), lambda x, p: F.layer_norm(x, (T, D), p)),
    ("x + (−p)[:T]", (T + 1, D), lambda x, p: x + (-p)[: x.shape[1]]),
    ("x ⊙ (p + c), c a constant of p's shape", (T, D), lambda x, p: x * (p + torch.ones(T, D))),
    ("x + p[:, :T] (minGPT's position table)", (1, T + 3, D), lambda x, p: x + p[:, :x.shape[1]]),
    ("x + p[:, ::2], a strided window", (1, 2 * T, D), lambda x, p: x + p[:, ::2]),
    ("x + p[None]", (T, D), lambda x, p: x + p[None]),
    ("x ⊙ p[1], a row", (3, T, D), lambda x, p: x * p[1]),
    ("x + p.squeeze(0)[:T].unsqueeze(0)", (1, T + 2, D), lambda x, p: x + p.squeeze(0)[:T].unsqueeze(0)),
    ("x ⊙ p.view(1, T, 1) (a per-channel scale)", (T,), lambda x, p: x * p.view(1, T, 1)),
    ("x ⊙ p.unsqueeze(-1) (PoolFormer's channels-first layer scale, a negative dim)", (T,),
     lambda x, p: x * p.unsqueeze(-1)),
    ("x ⊙ p.unsqueeze(-1).unsqueeze(-1)[0], negative dims twice", (T,),
     lambda x, p: x * p.unsqueeze(-1).unsqueeze(-1)[..., 0]),
    ("x ⊙ p[-1], a row at a negative index", (3, T, D), lambda x, p: x * p[-1]),
    ("x ⊙ p.select(-1, -2), a negative dim and index", (T, D, 3), lambda x, p: x * p.select(-1, -2)),
    ("x + p[-T:], a window from a negative start", (T + 2, D), lambda x, p: x + p[-T:]),
    ("x + p[:-2], a window to a negative end", (T + 2, D), lambda x, p: x + p[:-2]),
    ("x + p[:, -T - 1:-1] along a negative dim", (1, T + 2, D), lambda x, p: x + p.narrow(-2, 1, T)),
    ("x + p.squeeze(-1)", (T, D, 1), lambda x, p: x + p.squeeze(-1)),
    ("x + p.permute(2, 1, 0).contiguous() (Swin's bias, copied)", (D, T, 1),
     lambda x, p: x + p.permute(2, 1, 0).contiguous()),
    ("x + p.reshape(T, D)[:T - 1] over a flat table", (T * D,), lambda x, p: x[:, :T - 1] + p.reshape(T, D)[:T - 1]),
    ("x + F.embedding(arange(T), p) (nanoGPT's wpe)", (T + 2, D),
     lambda x, p: x + F.embedding(torch.arange(x.shape[1]), p)),
    ("x + F.embedding(arange(T), p, padding_idx=1)", (T + 2, D),
     lambda x, p: x + F.embedding(torch.arange(x.shape[1]), p, padding_idx=1)),
    ("x + F.embedding(indices that repeat, p)[None]", (2, D),
     lambda x, p: x + F.embedding(torch.tensor([0, 1, 0])[: x.shape[1]], p)[None]),
    ("x + p[index].permute(1, 2, 0) (Swin's relative-position table)", (7, 1, T),
     lambda x, p: x + p[torch.tensor([0, 3, 6, 3])].permute(1, 2, 0)),
    ("x + p[index].permute(-2, -1, 0), negative dims", (7, 1, T),
     lambda x, p: x + p[torch.tensor([1, 2, 1, 5])].permute(-2, -1, 0)),
    ("x + p[negative index].permute(1, 2, 0)", (7, 1, T), lambda x, p: x + p[torch.tensor([-1, 0, -2, 1])].permute(1, 2, 0)),
    ("x + F.embedding(buckets (T, D), p).permute(2, 0, 1) (T5's relative bias)", (6, 1),
     lambda x, p: x + F.embedding(torch.arange(T * D).reshape(T, D) % 6, p).permute(2, 0, 1)),
]


def _exact_example_grads(use, x: torch.Tensor, p: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    def loss(p_, xi, wi):
        return (torch.tanh(use(xi[None], p_)) * wi[None]).sum()
    return vmap(grad(loss), in_dims=(None, 0, 0))(p.detach(), x, weights).reshape(x.shape[0], -1)


@pytest.mark.parametrize("name, shape, use", USES, ids=[u[0] for u in USES])
def test_example_grads_at_each_broadcast_match_torch_func(name, shape, use):
    x, p = torch.randn(B, T, D), nn.Parameter(torch.randn(*shape))
    out = torch.tanh(use(x, p))
    weights = torch.randn_like(out)
    consumers, unread = find_consumers([out], {id(p): p})
    assert consumers and not unread
    rows = []

    def read(grads, consumer):
        dim = examples_dim(consumer, grads[0], B)
        if dim is not None or not consumer.dual:  # a table looked up, then broadcast: one of its readings reads it
            rows.append(example_grads(consumer, grads[0], dim).rows())

    for consumer in consumers:
        consumer.node.register_prehook(partial(read, consumer=consumer))
    (out * weights).sum().backward()
    total = sum(rows)
    torch.testing.assert_close(total, _exact_example_grads(use, x, p, weights), rtol=1e-5, atol=1e-6)
    assert adds_up_to(total.sum(dim=0), p.grad)


def test_sequence_first_activations_hold_the_examples_in_dim_1():
    x, p = torch.randn(T, B, D), nn.Parameter(torch.randn(T, 1, D))
    out = torch.tanh(x + p)
    (consumer,), _ = find_consumers([out], {id(p): p})
    rows = []
    consumer.node.register_prehook(lambda g: rows.append(
        example_grads(consumer, g[0], batch_dim(g[0].shape, p.shape, B, sequence_first=True)).rows()))
    out.sum().backward()
    exact = vmap(grad(lambda p_, xi: torch.tanh(xi[:, None] + p_).sum()), in_dims=(None, 1))(p.detach(), x)
    torch.testing.assert_close(rows[0], exact.reshape(B, -1))


def test_the_batch_dim_is_one_the_parameter_is_broadcast_along():
    assert batch_dim(torch.Size([8, 5, 4]), torch.Size([1, 5, 4]), 8) == 0
    assert batch_dim(torch.Size([8, 5, 4]), torch.Size([4]), None) == 0
    assert batch_dim(torch.Size([5, 8, 4]), torch.Size([5, 1, 4]), 8, sequence_first=True) == 1
    assert batch_dim(torch.Size([5, 8, 4]), torch.Size([5, 1, 4]), 8) == 1  # the only dim that fits
    assert batch_dim(torch.Size([8, 8, 4]), torch.Size([4]), 8) == 0  # batch-first: dim 0 where it fits
    assert batch_dim(torch.Size([8, 8, 4]), torch.Size([4]), 8, sequence_first=True) is None  # can't be told
    assert batch_dim(torch.Size([8, 10]), torch.Size([]), 8, sequence_first=True) == 0  # a head's output
    assert batch_dim(torch.Size([8, 4]), torch.Size([8, 4]), 8) is None  # not broadcast over the examples
    assert batch_dim(torch.Size([4]), torch.Size([1, 4]), 8) is None


def test_a_use_through_another_op_is_reported_unread():
    x, p = torch.randn(B, D), nn.Parameter(torch.randn(D, D))
    out = (x @ p) + p.sum(dim=0)
    consumers, unread = find_consumers([out], {id(p): p})
    assert unread == {id(p): "SumBackward1"}
    assert [type(c.node).__name__ for c in consumers] == ["MmBackward0"]  # read: :mod:`.matmul`



def test_a_shift_that_broadcasts_the_parameter_is_not_passed_over():
    """``p + c`` with ``c`` larger than ``p``: the sum's gradient is not ``p``'s, so it is read at that sum, whose
    output holds no examples (and is left out there)."""
    x, p = torch.randn(B, T, D), nn.Parameter(torch.randn(D))
    out = x * (p + torch.ones(T, D))
    (consumer,) = find_consumers([out], {id(p): p})[0]
    assert type(consumer.node).__name__ == "AddBackward0" and consumer.path.shape == (D,)
    assert examples_dim(consumer, torch.randn(T, D), B) is None


class LayerScale(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Mixer(nn.Module):
    """A weight applied by a matrix product of its own, and a penalty through another op as well."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.weight.sum()


def _pass(tracker, model, x, weights):
    model.zero_grad()
    (model(x) * weights).sum().backward()
    return tracker.pop()


def test_a_vit_is_measured_whole_from_its_first_pass(reference_sq_norms):
    torch.manual_seed(0)
    model, x = ViTStyle(), torch.randn(6, 1, 8, 8)
    weights = torch.randn(6, 10)
    tracker = PerExampleNormTracker(model).attach()
    assert tracker.coverage_fraction() < 0.9 and "cls" in tracker.excluded_reasons  # left out until shown
    exact = reference_sq_norms(model, x, weights).float()
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, x, weights), exact, rtol=1e-4, atol=0)
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


def test_a_layer_scale_and_a_subset_of_examples(assert_subset_reads_exactly):
    torch.manual_seed(0)
    assert_subset_reads_exactly(nn.Sequential(nn.Linear(8, 8), LayerScale(8), nn.Tanh(), nn.Linear(8, 3)))


def test_a_parameter_used_through_an_unread_op_stays_left_out(reference_sq_norms):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Mixer(8), nn.Tanh(), nn.Linear(8, 3))
    x, weights = torch.randn(6, 8), torch.randn(6, 3)
    tracker = PerExampleNormTracker(model).attach()
    assert tracker.coverage_fraction() + tracker.bare_parameter_fraction() == 1.0  # what fit start counts on
    with pytest.warns(UserWarning, match=r"left the bare parameter '1.weight' out.*SumBackward0.*cover 60.7%"):
        got = _pass(tracker, model, x, weights)
    names = ["0.weight", "0.bias", "3.weight", "3.bias"]
    torch.testing.assert_close(got, reference_sq_norms(model, x, weights, param_names=names).float(), rtol=1e-4,
                               atol=0)
    assert "SumBackward0" in tracker.excluded_reasons["1.weight"]


class Offset(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset


def test_a_second_use_inside_the_forward_leaves_the_parameter_out():
    class Penalised(Offset):
        def forward(self, x):
            return x + self.offset + self.offset.square().sum()

    model = nn.Sequential(Penalised(8), nn.Linear(8, 3))
    tracker = PerExampleNormTracker(model).attach()
    model(torch.randn(6, 8)).sum().backward()
    tracker.pop()
    assert "PowBackward0" in tracker.excluded_reasons["0.offset"] and tracker.coverage_fraction() < 1.0


def test_a_parameter_whose_broadcast_is_not_its_whole_gradient_stays_left_out(reference_sq_norms):
    """Used again outside its module (a penalty in the loss): the examples' gradients at the broadcast do not add
    up to its gradient, so it stays out, and the pass's norms are the rest's."""
    torch.manual_seed(0)
    model, x, weights = nn.Sequential(Offset(8), nn.Linear(8, 3)), torch.randn(6, 8), torch.randn(6, 3)
    tracker = PerExampleNormTracker(model).attach()
    ((model(x) * weights).sum() + model[0].offset.square().sum()).backward()
    got = tracker.pop()
    torch.testing.assert_close(got, reference_sq_norms(model, x, weights, param_names=["1.weight", "1.bias"]).float(),
                               rtol=1e-4, atol=0)
    assert "do not add up" in tracker.excluded_reasons["0.offset"] and tracker.coverage_fraction() < 1.0


def test_a_measured_parameter_later_used_another_way_is_left_out_with_a_warning(reference_sq_norms):
    """Measured from its first pass; when a later forward uses it through another op, it is left out from that
    pass on (never half-measured), and the user is told once."""
    class Switching(Offset):
        exp = False

        def forward(self, x):
            return x + (self.offset.exp() if self.exp else self.offset)

    torch.manual_seed(0)
    model, x, weights = nn.Sequential(Switching(8), nn.Linear(8, 3)), torch.randn(6, 8), torch.randn(6, 3)
    tracker = PerExampleNormTracker(model).attach()
    torch.testing.assert_close(_pass(tracker, model, x, weights), reference_sq_norms(model, x, weights).float(),
                               rtol=1e-4, atol=0)
    assert tracker.coverage_fraction() == 1.0
    model[0].exp = True
    with pytest.warns(UserWarning, match="'0.offset' out of both norms from now on.*ExpBackward0"):
        got = _pass(tracker, model, x, weights)
    torch.testing.assert_close(got, reference_sq_norms(model, x, weights, param_names=["1.weight", "1.bias"]).float(),
                               rtol=1e-4, atol=0)
    assert tracker.coverage_fraction() < 1.0 and "ExpBackward0" in tracker.excluded_reasons["0.offset"]


def test_an_overflowing_first_pass_leaves_the_check_to_the_next(reference_sq_norms):
    """fp16 with a gradient scaler: the first steps often overflow (the scaler skips them). Such a pass's gradient
    tells nothing, so the bare parameter is neither measured nor left out for good on it."""
    torch.manual_seed(0)
    model, x, weights = nn.Sequential(Offset(8), nn.Linear(8, 3)), torch.randn(6, 8), torch.randn(6, 3)
    tracker = PerExampleNormTracker(model).attach()
    model.zero_grad()
    ((model(x) * weights).sum() * float("inf")).backward()
    tracker.pop()
    assert "0.offset" in tracker.excluded_reasons and tracker.bare_parameter_fraction() > 0
    torch.testing.assert_close(_pass(tracker, model, x, weights), reference_sq_norms(model, x, weights).float(),
                               rtol=1e-4, atol=0)
    assert tracker.coverage_fraction() == 1.0


def test_a_parameter_added_in_place_to_the_module_s_input_is_found(reference_sq_norms):
    """The walk stops at the graph made before the forward: its inputs' nodes as they were before it, not after an
    in-place ``x += p`` made the consumer their node."""
    class InPlace(Offset):
        def forward(self, x):
            x += self.offset
            return x

    torch.manual_seed(0)
    model, x, weights = nn.Sequential(nn.Linear(8, 8), InPlace(8), nn.Linear(8, 3)), torch.randn(6, 8), torch.randn(6, 3)
    tracker = PerExampleNormTracker(model).attach()
    torch.testing.assert_close(_pass(tracker, model, x, weights), reference_sq_norms(model, x, weights).float(),
                               rtol=1e-4, atol=0)
    assert tracker.coverage_fraction() == 1.0


def test_a_position_table_sliced_to_the_sequence_is_measured_whole(reference_sq_norms):
    """minGPT's ``x + self.pos_emb[:, :T]``: the table's rows past ``T`` get no gradient; each example's gradient of
    the first ``T`` is read at the add and placed in its window."""
    from benchmarks.model_scan import MinGptStyle

    torch.manual_seed(0)
    model, tokens, weights = MinGptStyle(), torch.randint(0, 17, (6, 12)), torch.randn(6, 10)
    tracker = PerExampleNormTracker(model).attach()
    assert "pos_emb" in tracker.excluded_reasons
    torch.testing.assert_close(_pass(tracker, model, tokens, weights), reference_sq_norms(model, tokens, weights).float(),
                               rtol=1e-4, atol=0)
    assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


def test_a_per_channel_scale_viewed_to_the_feature_map_is_measured_whole(reference_sq_norms):
    """``x * self.gamma.view(1, -1, 1, 1)`` after a convolution: a view's output shape is read from torch's record
    of the gradient it takes."""
    class ChannelScale(nn.Module):
        def __init__(self, channels):
            super().__init__()
            self.gamma = nn.Parameter(torch.rand(channels) + 0.5)

        def forward(self, x):
            return x * self.gamma.view(1, -1, 1, 1)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), ChannelScale(4), nn.Tanh(), nn.Flatten(), nn.Linear(16, 3))
    x, weights = torch.randn(6, 2, 4, 4), torch.randn(6, 3)
    tracker = PerExampleNormTracker(model).attach()
    torch.testing.assert_close(_pass(tracker, model, x, weights), reference_sq_norms(model, x, weights).float(),
                               rtol=1e-4, atol=0)
    assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


class NanoGptTables(nn.Module):
    """nanoGPT's layout: the token and position tables in a ``ModuleDict`` (no forward of its own), the position
    table looked up on ``arange(T)`` by the root's forward and broadcast over the batch; here half the model."""

    def __init__(self, padding_idx=None):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(17, 8), wpe=nn.Embedding(40, 8, padding_idx=padding_idx)))
        self.head = nn.Linear(8, 10)

    def forward(self, tokens):
        h = self.transformer.wte(tokens) + self.transformer.wpe(torch.arange(tokens.shape[1]))
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_a_position_table_looked_up_on_arange_is_measured_whole_from_its_first_pass(reference_sq_norms, padding_idx):
    """Its lookup's output is broadcast over the batch, so its own output gradient is already summed over the
    examples; read at the add instead, as a bare parameter of the module that calls it (the root here: the
    ``ModuleDict`` has no forward). Before, its backward failed the pass ("not measured") where it was over a tenth
    of the model, and it was left out elsewhere."""
    torch.manual_seed(0)
    model, tokens, weights = NanoGptTables(padding_idx), torch.randint(0, 17, (6, 12)), torch.randn(6, 10)
    tracker = PerExampleNormTracker(model).attach()
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, tokens, weights),
                                   reference_sq_norms(model, tokens, weights).float(), rtol=1e-4, atol=0)
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


def test_a_shared_table_used_where_its_examples_gradients_are_not_read_is_left_out_with_a_warning():
    """The table's rows are summed before they meet the examples: no broadcast of them is read, so the table is
    left out for good, with the reason, and the rest is measured (its share said in the warning)."""
    class SummedTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos, self.head = nn.Embedding(20, 4), nn.Linear(12, 3)

        def forward(self, tokens):
            return self.head(self.pos(torch.arange(tokens.shape[1])).sum(-1) + tokens.float())

    model = SummedTable()
    tracker = PerExampleNormTracker(model).attach()
    tokens, weights = torch.randint(0, 5, (6, 12)), torch.randn(6, 3)
    with pytest.warns(UserWarning, match="left the bare parameter 'pos.weight' out"):
        for _ in range(2):
            model.zero_grad()
            (model(tokens) * weights).sum().backward()
            (record,) = tracker.pop_passes()
            assert record.failure is None
    assert tracker.coverage_fraction() < 1.0 and "arange" in tracker.excluded_reasons["pos.weight"]


def test_a_lookup_whose_indices_may_hold_the_examples_is_not_read():
    """``p[tokens]`` with one token per example, broadcast along positions as many as the examples: its rows are
    the examples', not a shared table's, and the positions' dim fits the batch's size, so it is not read."""
    x, p = torch.randn(B, B, D), nn.Parameter(torch.randn(9, D))
    out = torch.tanh(x + p[torch.tensor([3, 1, 4, 1, 5])].unsqueeze(1))
    (consumer,), unread = find_consumers([out], {id(p): p})
    dims = []
    consumer.node.register_prehook(lambda g: dims.append(examples_dim(consumer, g[0], B)))
    out.sum().backward()
    assert dims == [None]


class RelativeBias(nn.Module):
    """One attention head over token embeddings with a relative-position bias added to its logits: T5's (an
    ``nn.Embedding`` of buckets, an (L, L) matrix with no batch dim) or Swin's (a bare table indexed by a buffer)."""

    def __init__(self, swin: bool, length: int = 10):
        super().__init__()
        self.emb, self.qk, self.head = nn.Embedding(17, 8), nn.Linear(8, 16), nn.Linear(length, 10)
        pos = torch.arange(length)
        self.register_buffer("buckets", (pos[None, :] - pos[:, None]).clamp(-3, 4) + 3)
        self.table = nn.Parameter(torch.randn(8, 2) * 0.5) if swin else None
        self.rel = None if swin else nn.Embedding(8, 2)

    def forward(self, tokens):
        q, k = self.qk(self.emb(tokens)).chunk(2, -1)
        length = tokens.shape[1]
        if self.table is not None:
            bias = self.table[self.buckets.reshape(-1)].view(length, length, 2).permute(2, 0, 1)
        else:
            bias = self.rel(self.buckets).permute(2, 0, 1)
        logits = (q @ k.transpose(-1, -2))[:, None] + bias[None]  # (B, 2, L, L)
        return self.head(logits.softmax(-1).mean((1, 2)))


@pytest.mark.parametrize("swin, batch, told", [(False, 6, True), (False, 10, True), (False, 6, False),
                                              (True, 6, True)],
                         ids=["T5's bucket embedding", "T5's, as many positions as examples",
                              "T5's, the batch's size not told", "Swin's indexed table"])
def test_a_relative_position_bias_is_measured_whole_from_its_first_pass(reference_sq_norms, swin, batch, told):
    """Before, T5's bucket embedding stopped the measurement ("neither dim 0 nor dim 1 holds the batch"), or with as
    many positions as examples was read as a batch (its rows, positions, as examples), and Swin's table was left out
    ("used through IndexBackward0")."""
    model, tokens, weights = RelativeBias(swin), torch.randint(0, 17, (batch, 10)), torch.randn(batch, 10)
    tracker = PerExampleNormTracker(model).attach()
    for _ in range(2):
        tracker.expected_batch_size = batch if told else None
        torch.testing.assert_close(_pass(tracker, model, tokens, weights),
                                   reference_sq_norms(model, tokens, weights).float(), rtol=1e-4, atol=0)
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons and tracker.failure is None


def test_windows_of_a_stream_at_falling_offsets_are_never_read_as_a_shared_table_s_rows(reference_sq_norms):
    """A batch of L sequences of L tokens, each the one before moved one token later (windows at offsets 11, 10, ...,
    0), is constant along its diagonals as relative-position buckets are: the token table is then handed to the
    broadcast path, where its lookup's indices hold the examples, so it is left out with the reason, and what is
    measured is exact. (Windows at rising offsets are constant along the other diagonals, and read as a batch.)"""
    stream = torch.randint(0, 17, (40,))
    tokens = torch.stack([stream[11 - i:23 - i] for i in range(12)])  # (12, 12): windows at offsets 11..0
    model, weights = NanoGptTables(), torch.randn(12, 10)
    tracker = PerExampleNormTracker(model).attach()
    with pytest.warns(UserWarning, match="left the bare parameter 'transformer.wte.weight' out"):
        got = _pass(tracker, model, tokens, weights)
    covered = {name for name, _ in model.named_parameters()} - {name for name, _ in tracker.uncovered_parameters()}
    assert covered == {"transformer.wpe.weight", "head.weight", "head.bias"}
    torch.testing.assert_close(got, reference_sq_norms(model, tokens, weights, covered).float(), rtol=1e-4,
                               atol=0)


class BareTables(nn.Module):
    """Tables of the model's own code looked up at each example's tokens: ``F.embedding(tokens, W)`` (maybe with a
    padding row) and ``V[tokens]`` (a negative token counting from the end; once under a sigmoid, once added),
    pooled to a head. ``sequence_first``: tokens ``(T, B)``."""

    def __init__(self, padding_idx=None, sequence_first=False) -> None:
        super().__init__()
        self.table, self.other = nn.Parameter(torch.randn(9, 4)), nn.Parameter(torch.randn(9, 4))
        self.head, self.padding_idx, self.positions = nn.Linear(4, 3), padding_idx, 0 if sequence_first else 1

    def forward(self, tokens):
        h = torch.tanh(F.embedding(tokens, self.table, padding_idx=self.padding_idx))
        h = h + torch.sigmoid(self.other[tokens - 9]) + self.other[tokens.flip(self.positions)]
        return self.head(h.mean(self.positions))


@pytest.mark.parametrize("padding_idx", [None, 2])
def test_bare_tables_looked_up_at_the_examples_tokens_are_measured_whole_from_their_first_pass(reference_sq_norms,
                                                                                               padding_idx):
    """Before, both tables were left out (used through a lookup whose output is not a broadcast)."""
    model = BareTables(padding_idx)
    tokens, weights = torch.randint(0, 9, (6, 5)), torch.randn(6, 3)
    tracker = PerExampleNormTracker(model).attach()
    exact = reference_sq_norms(model, tokens, weights).float()
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, tokens, weights), exact, rtol=1e-5, atol=0)
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


def test_a_bare_table_looked_up_at_sequence_first_tokens():
    """Tokens ``(T, B)``: the examples in dim 1 of the indices, each example's norm its own."""
    torch.manual_seed(0)
    model = BareTables()
    tokens, weights = torch.randint(0, 9, (6, 5)), torch.randn(6, 3)
    batch_first = _pass(PerExampleNormTracker(model).attach(), model, tokens, weights)
    torch.manual_seed(0)
    model = BareTables(sequence_first=True)
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 6
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, tokens.t(), weights), batch_first, rtol=1e-5, atol=0)
        assert tracker.coverage_fraction() == 1.0


@pytest.mark.parametrize("counted", ["expand", "mask", "shared", "slice"])
@pytest.mark.parametrize("two_towers, tied_head", [(False, False), (True, False), (True, True)],
                         ids=["one table", "a table two subclasses hold", "and a head"])
def test_subclassed_embeddings_are_measured_whole_from_their_first_pass(reference_sq_norms, counted, two_towers,
                                                                        tied_head):
    """A subclass of ``nn.Embedding`` with a forward of its own holds a bare table, read at its lookup. Before, a
    position table whose module returns its rows (``return super().forward(positions)``, ``weight[:T]``) was left out:
    the walk from its output began above the lookup, and a table shared by the examples meets them only in the
    caller's forward (41% coverage on this model); and a table two subclasses and a head hold was left out as
    "shared by several modules". The head's product and the lookups are one gradient: its cross term is read at the
    examples' tokens (:class:`~gns_callback.per_example.bare_lookup.TiedGrads`)."""
    from tests.trust.models import SubclassedEmbeddings

    model = SubclassedEmbeddings(counted, two_towers, tied_head)
    tokens, weights = torch.randint(0, 17, (6, 7)), torch.randn(6, 10)
    tokens[:, -2:] = 0  # padding, for OPT's count of positions
    tracker = PerExampleNormTracker(model).attach()
    exact = reference_sq_norms(model, tokens, weights).float()
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, tokens, weights), exact, rtol=1e-5, atol=0)
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


class ReturnsItsTable(nn.Module):
    """A module whose forward returns its table as it is; its caller uses it through a running sum, an op whose
    per-example gradients are not read."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 4))

    def forward(self):
        return self.table


def test_a_table_its_module_returns_is_left_out_where_its_caller_uses_it_through_an_op_not_read(reference_sq_norms):
    """Handed over to the caller, whose walk finds no use it reads: left out with the reason, the rest exact."""
    torch.manual_seed(0)
    model = nn.Module()
    model.table, model.head = ReturnsItsTable(), nn.Linear(4, 3)
    model.forward = lambda x: model.head(x * torch.cumsum(model.table(), 0))
    x, weights = torch.randn(6, 7, 4), torch.randn(6, 7, 3)
    tracker = PerExampleNormTracker(model).attach()
    with pytest.warns(UserWarning, match="left the bare parameter 'table.table' out"):
        got = _pass(tracker, model, x, weights)
    assert "table.table" in tracker.excluded_reasons
    covered = {"head.weight", "head.bias"}
    torch.testing.assert_close(got, reference_sq_norms(model, x, weights, covered).float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("offset", [0, 2])
def test_a_position_table_at_an_offset_with_as_many_positions_as_examples_is_read_at_its_broadcast(
        reference_sq_norms, offset):
    """``nn.Embedding`` at ``arange(T) + offset``, T equal to the batch's size: shared positions, read where their
    rows meet the examples. Before, with an offset, the indices were taken for the examples' own: wrong norms."""
    from tests.trust.models import OffsetPositions

    model = OffsetPositions(offset)
    with torch.no_grad():
        model.positions.weight.mul_(4)  # the position rows' part of the norms, large
    pixels = torch.randint(0, 17, (32, 64))
    weights = torch.randn(32, 10)
    tracker = PerExampleNormTracker(model).attach()
    exact = reference_sq_norms(model, pixels, weights).float()
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, pixels, weights), exact, rtol=1e-5, atol=0)


class SharedWeight(nn.Module):
    """Two ``nn.Linear`` holding one weight (each its own bias), one after the other, under a head."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second, self.head = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.second.weight = self.first.weight

    def forward(self, x):
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


def test_a_weight_two_linear_layers_hold_is_measured_whole_from_its_first_pass(reference_sq_norms):
    """Read at both products, each example's gradient their sum. Before, left out as "shared by several modules"
    (52% of this model)."""
    torch.manual_seed(0)
    model, x, weights = SharedWeight(), torch.randn(5, 4, 6), torch.randn(5, 4, 3)
    tracker = PerExampleNormTracker(model).attach()
    exact = reference_sq_norms(model, x, weights).float()
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, x, weights), exact, rtol=1e-5, atol=0)
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


def test_a_subset_of_subclassed_embeddings_with_a_tied_head_reads_exactly(assert_subset_reads_exactly):
    from tests.trust.models import SubclassedEmbeddings

    assert_subset_reads_exactly(SubclassedEmbeddings("expand", True, True), torch.randint(0, 17, (10, 7)))


HUGGING_FACE = {  # config class, model class, config arguments (tiny)
    "OPTModel": ("OPTConfig", "OPTModel", dict(hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
                                               word_embed_proj_dim=16, max_position_embeddings=16, dropout=0.0)),
    "BartForConditionalGeneration": ("BartConfig", "BartForConditionalGeneration", dict(
        d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=16, dropout=0.0, scale_embedding=True)),
    "GemmaModel": ("GemmaConfig", "GemmaModel", dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                     num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                                     max_position_embeddings=16)),
}


@pytest.mark.parametrize("name", list(HUGGING_FACE))
def test_hugging_face_models_with_subclassed_tables_or_shifted_norms_are_measured_whole(reference_sq_norms, name):
    """OPT's and BART's subclassed embeddings (BART's table tied to its head) and Gemma's ``1 + weight`` norms, against
    ``torch.func`` in float64. Before: 90%, 90% and 99% of these models (RESULTS.md). Only with ``transformers``."""
    transformers = pytest.importorskip("transformers")
    config, model_class, kwargs = HUGGING_FACE[name]
    body = getattr(transformers, model_class)(getattr(transformers, config)(vocab_size=17, **kwargs))

    class Outputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body

        def forward(self, tokens):
            out = self.body(input_ids=tokens)
            return out.logits if hasattr(out, "logits") else out.last_hidden_state

    model = Outputs().double()
    tokens = torch.randint(3, 17, (5, 10))
    weights = torch.randn_like(model(tokens))
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 5  # OPT's feed-forward runs on rows flattened to (B·T, D)
    got = _pass(tracker, model, tokens, weights)
    assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons
    torch.testing.assert_close(got, reference_sq_norms(model, tokens, weights).float(), rtol=1e-5, atol=0)


@pytest.mark.parametrize("through_conv", [False, True], ids=["as a product", "as a convolution"])
def test_a_layer_whose_parameters_are_used_outside_its_forward_is_read_where_they_are_used(reference_sq_norms,
                                                                                        through_conv):
    """Its gradient comes without its output's. Before, the pass failed and nothing more was measured. Now its
    parameters are handed to the module that uses them, that pass's step is dropped (its norms lack them), and from
    the next on they are read at their product and broadcast, or left out with the reason where their use is not
    read (a convolution), the rest still exact."""
    from tests.trust.models import LayerUsedOutside

    model, x, weights = LayerUsedOutside(through_conv), torch.randn(6, 64), torch.randn(6, 10)
    tracker = PerExampleNormTracker(model).attach()
    with pytest.warns(UserWarning, match="'hidden' are used outside its forward"):
        assert not _pass_records(tracker, model, x, weights)
    covered = {"head.weight", "head.bias"} if through_conv else None
    for _ in range(2):
        (record,) = _pass_records(tracker, model, x, weights)
        torch.testing.assert_close(record.sq_norms, reference_sq_norms(model, x, weights, covered).float(),
                                   rtol=1e-5, atol=0)
    assert tracker.coverage_fraction() == (33 * 10 / (65 * 32 + 33 * 10) if through_conv else 1.0)
    assert ("hidden.weight" in tracker.excluded_reasons) == through_conv


def _pass_records(tracker, model, x, weights):
    model.zero_grad()
    (model(x) * weights).sum().backward()
    return tracker.pop_passes()
