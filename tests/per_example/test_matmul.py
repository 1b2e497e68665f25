"""A bare parameter used as a matrix product's weight, written out in a module's own forward (``x @ W``,
``F.linear(x, W, b)``): its per-example gradients read at the product against ``torch.func``, and the tracker,
which measures it from its first pass on and leaves it out where the examples' rows can't be told apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, vmap

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example import matmul as matmul_module
from gns_callback.per_example import tracker as tracker_module
from gns_callback.per_example.broadcast import adds_up_to, example_grads, examples_dim, find_consumers
from gns_callback.per_example.matmul import Factors

B, T, K, L = 5, 3, 4, 6

#: (name, input shape, parameter shapes, use of the parameters on the input x).
USES = [
    ("x @ W", (B, K), [(K, L)], lambda x, w: x @ w),
    ("x @ W over positions", (B, T, K), [(K, L)], lambda x, w: x @ w),
    ("x @ W over two position dims", (B, 2, T, K), [(K, L)], lambda x, w: torch.matmul(x, w)),
    ("x @ W.T", (B, T, K), [(L, K)], lambda x, w: x @ w.T),
    ("F.linear(x, W, b)", (B, K), [(L, K), (L,)], lambda x, w, b: F.linear(x, w, b)),
    ("F.linear(x, W, b) over positions", (B, T, K), [(L, K), (L,)], lambda x, w, b: F.linear(x, w, b)),
    ("x @ W then viewed as heads", (B, K), [(K, L)], lambda x, w: (x @ w).unflatten(-1, (2, L // 2))),
    ("x @ W at every step of a recurrence", (B, T, K), [(K, K)],
     lambda x, w: torch.stack([x[:, t] @ w @ w for t in range(x.shape[1])], 1)),
    ("W @ xᵀ over positions (matmul folds it as x @ Wᵀ)", (B, T, K), [(L, K)],
     lambda x, w: w @ x.transpose(-1, -2)),
    ("bmm with W expanded over the batch (read at the expand)", (B, T, K), [(K, L)],
     lambda x, w: torch.bmm(x, w.expand(x.shape[0], K, L))),
    ("x @ W.transpose(-1, -2) and x @ W.permute(0, 1)", (B, K), [(K, K)],
     lambda x, w: x @ w.transpose(-1, -2) + x @ w.permute(0, 1)),
    ("x @ W, then h @ W.T (a tied autoencoder)", (B, T, K), [(K, L)], lambda x, w: torch.tanh(x @ w) @ w.T),
    ("x @ W + W (a broadcast too)", (B, K, K), [(K, K)], lambda x, w: x @ w + w),
]


def _exact(use, x: torch.Tensor, params: list[torch.Tensor], weights: torch.Tensor) -> torch.Tensor:
    def loss(ps, xi, wi):
        return (torch.tanh(use(xi[None], *ps)) * wi[None]).sum()
    grads = vmap(grad(loss), in_dims=(None, 0, 0))([p.detach() for p in params], x, weights)
    return torch.cat([g.reshape(x.shape[0], -1) for g in grads], dim=1)


@pytest.mark.parametrize("name, in_shape, shapes, use", USES, ids=[u[0] for u in USES])
@pytest.mark.parametrize("input_grad", [False, True], ids=["data input", "activation input"])
def test_example_grads_at_each_product_match_torch_func(name, in_shape, shapes, use, input_grad):
    x = torch.randn(*in_shape, requires_grad=input_grad)
    params = [nn.Parameter(torch.randn(*shape)) for shape in shapes]
    out = torch.tanh(use(x * 1 if input_grad else x, *params))
    weights = torch.randn_like(out)
    consumers, unread = find_consumers([out], {id(p): p for p in params})
    assert consumers and not unread
    found = {id(p): [] for p in params}

    def keep(grads, consumer):
        dim = examples_dim(consumer, grads[0], B)
        found[id(consumer.param)].append(example_grads(consumer, grads[0], dim))
    for consumer in consumers:
        consumer.hooked.register_prehook(lambda grads, c=consumer: keep(grads, c))
    (out * weights).sum().backward()
    exact = _exact(use, x.detach(), params, weights)
    got = torch.cat([_rows(found[id(p)]) for p in params], dim=1)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
    start = 0
    for p in params:
        exact_p, start = exact[:, start:start + p.numel()], start + p.numel()
        assert adds_up_to(_rows(found[id(p)]).sum(dim=0), p.grad)
        if all(isinstance(f, Factors) for f in found[id(p)]):  # norms and sum without materialising
            factors = _joined(found[id(p)])
            torch.testing.assert_close(factors.sq_norms(), exact_p.square().sum(dim=1), rtol=1e-4, atol=1e-5)
            assert adds_up_to(factors.summed(), p.grad)


def _joined(factors: list[Factors]) -> Factors:
    total = factors[0]
    for more in factors[1:]:
        total = total.joined(more)
    return total


def _rows(found: list) -> torch.Tensor:
    return sum(f.rows() for f in found)


def test_sequence_first_rows_hold_the_examples_in_dim_1():
    x, w = torch.randn(T, B, K), nn.Parameter(torch.randn(K, L))
    out = torch.tanh(x @ w)
    (consumer,), _ = find_consumers([out], {id(w): w})
    rows = []
    consumer.hooked.register_prehook(lambda g: rows.append(
        example_grads(consumer, g[0], examples_dim(consumer, g[0], B, sequence_first=True)).rows()))
    out.sum().backward()
    exact = vmap(grad(lambda w_, xi: torch.tanh(xi[:, None] @ w_).sum()), in_dims=(None, 1))(w.detach(), x)
    torch.testing.assert_close(rows[0], exact.reshape(B, -1))


def test_rows_that_are_not_the_examples_are_not_read():
    """Rows that can't be told apart by example: none fits the batch, or a square sequence-first batch."""
    w = nn.Parameter(torch.randn(K, L))
    for x, sequence_first in [(torch.randn(B * T, K), False), (torch.randn(B, B, K), True)]:
        out = x @ w
        (consumer,), _ = find_consumers([out], {id(w): w})
        dims = []
        consumer.hooked.register_prehook(lambda g, c=consumer, s=sequence_first: dims.append(
            examples_dim(c, g[0], B, sequence_first=s)))
        out.sum().backward()
        assert dims == [None]


def test_a_2d_left_factor_and_einsum_are_not_read():
    x, w = torch.randn(B, T, K), nn.Parameter(torch.randn(K, K))
    for out, kind in [((w @ x[:, 0].T).T, "MmBackward0"), (torch.einsum("btk,kl->btl", x, w), "")]:
        consumers, unread = find_consumers([out], {id(w): w})
        assert not consumers and id(w) in unread and kind in unread[id(w)]


class Dense(nn.Module):
    """A linear layer written out with bare parameters, as hand-written models do."""

    def __init__(self, fan_in: int, fan_out: int, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        shape = (fan_out, fan_in) if transposed else (fan_in, fan_out)
        self.weight = nn.Parameter(torch.randn(*shape) / fan_in**0.5)
        self.bias = nn.Parameter(torch.zeros(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.transposed else x @ self.weight + self.bias


def _pass(tracker, model, x, weights):
    model.zero_grad()
    (model(x) * weights).sum().backward()
    return tracker.pop()


@pytest.mark.parametrize("in_shape", [(6, 8), (6, 3, 8)], ids=["rows", "positions"])
@pytest.mark.parametrize("transposed", [False, True], ids=["x @ W + b", "F.linear"])
def test_a_hand_written_dense_layer_is_measured_whole_from_its_first_pass(in_shape, transposed, reference_sq_norms):
    model = nn.Sequential(Dense(8, 8, transposed), nn.Tanh(), Dense(8, 3, not transposed))
    x = torch.randn(*in_shape)
    weights = torch.randn(*in_shape[:-1], 3)
    tracker = PerExampleNormTracker(model).attach()
    assert tracker.coverage_fraction() == 0.0 and tracker.bare_parameter_fraction() == 1.0
    exact = reference_sq_norms(model, x, weights).float()
    for _ in range(2):
        torch.testing.assert_close(_pass(tracker, model, x, weights), exact, rtol=1e-4, atol=0)
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


def test_a_subset_of_examples(assert_subset_reads_exactly):
    assert_subset_reads_exactly(nn.Sequential(nn.Linear(8, 8), Dense(8, 8), nn.Tanh(), nn.Linear(8, 3)))


class MixedUse(nn.Module):
    """A weight used at a product and at a broadcast (added to every example's activations) in one forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 8**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.weight


def test_a_weight_used_at_a_product_and_a_broadcast_adds_its_materialised_gradients(reference_sq_norms):
    model = nn.Sequential(MixedUse(), nn.Tanh(), nn.Linear(8, 3))
    x, weights = torch.randn(6, 8, 8), torch.randn(6, 8, 3)
    tracker = PerExampleNormTracker(model).attach()
    torch.testing.assert_close(_pass(tracker, model, x, weights), reference_sq_norms(model, x, weights).float(),
                               rtol=1e-4, atol=0)
    assert tracker.coverage_fraction() == 1.0


def test_one_too_large_to_materialise_is_left_out(monkeypatch, reference_sq_norms):
    monkeypatch.setattr(tracker_module, "MAX_ROWS_ELEMENTS", 6 * 64 - 1)
    model = nn.Sequential(MixedUse(), nn.Tanh(), nn.Linear(8, 3))
    x, weights = torch.randn(6, 8, 8), torch.randn(6, 8, 3)
    tracker = PerExampleNormTracker(model).attach()
    with pytest.warns(UserWarning, match="left the bare parameter '0.weight' out.*more than 383 are held"):
        got = _pass(tracker, model, x, weights)
    torch.testing.assert_close(got, reference_sq_norms(model, x, weights, param_names=["2.weight", "2.bias"]).float(),
                               rtol=1e-4, atol=0)
    assert matmul_module.MAX_ROWS_ELEMENTS == 2**25


def test_a_model_whose_every_parameter_is_left_out_stops_measuring():
    class Einsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 3))

        def forward(self, x):
            return torch.einsum("bk,kl->bl", x, self.weight)

    model = Einsum()
    tracker = PerExampleNormTracker(model).attach()
    model(torch.randn(6, 8)).sum().backward()
    with pytest.raises(RuntimeError, match="every trainable parameter is left out.*'weight'.*method='micro_batch'"):
        tracker.pop()


def test_a_weight_whose_rows_can_t_be_told_apart_is_left_out():
    """Rows viewed back into one flat row per example: not the product's own (rows, width), so its rows are not
    grouped by guess; the weight is left out."""
    class Flattening(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return (x.reshape(-1, x.shape[-1]) @ self.weight).reshape(x.shape[0], -1)

    model = nn.Sequential(Flattening(), nn.Tanh(), nn.Linear(24, 3))
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 6
    with pytest.warns(UserWarning, match="left the bare parameter '0.weight' out.*no dim of the batch"):
        _pass(tracker, model, torch.randn(6, 3, 8), torch.randn(6, 3))
    assert tracker.coverage_fraction() < 1.0


@pytest.mark.parametrize("transposed", [False, True], ids=["x @ W + b", "F.linear"])
def test_under_bf16_autocast_the_cast_weight_is_read(transposed, reference_sq_norms):
    """Autocast casts the weight before the product (a ``ToCopyBackward0`` node between them): read through it,
    the norms are float32's to bf16 rounding, and the add-up check allows bf16's rounding."""
    model = nn.Sequential(Dense(8, 16, transposed), nn.Tanh(), Dense(16, 3, not transposed))
    x, weights = torch.randn(6, 4, 8), torch.randn(6, 4, 3)
    tracker = PerExampleNormTracker(model).attach()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    (out.float() * weights).sum().backward()
    got = tracker.pop()
    assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons
    torch.testing.assert_close(got, reference_sq_norms(model, x, weights).float(), rtol=5e-2, atol=0)


def test_a_weight_multiplying_a_learned_table_is_left_out():
    """``self.prototypes @ W``: the rows are a table's, not the examples' (here as many as the batch), so the
    weight is left out, never measured per prototype."""
    class Prototypes(nn.Module):
        def __init__(self):
            super().__init__()
            self.prototypes, self.weight = nn.Parameter(torch.randn(6, 8)), nn.Parameter(torch.randn(8, 4))

        def forward(self, x):
            return x @ (self.prototypes @ self.weight).T

    model = nn.Sequential(nn.Linear(8, 4), Prototypes())
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 6
    with pytest.warns(UserWarning, match="left the bare parameter"):
        _pass(tracker, model, torch.randn(6, 8), torch.randn(6, 6))
    assert "1.weight" in tracker.excluded_reasons and tracker.coverage_fraction() < 1.0


@pytest.mark.parametrize("scaled", [lambda b: 2 * b, lambda b: b / 4, lambda b: b * nn.Parameter(torch.tensor(2.0))],
                         ids=["2 * B", "B / 4", "B * learned scale"])
def test_a_weight_multiplying_a_table_computed_from_parameters_is_left_out(scaled):
    """A low-rank adapter merged into a weight, ``W0 + 2 * B @ A``: ``A``'s product has ``B``'s rows, computed from
    parameters alone, as many as the batch here. Before, they were read as examples (a plain loop at its defaults on
    the digits read B_simple = 14.8, 95% CI 14.6-15.1, against an exact 3.41 of the parameters it measured:
    tests/trust/test_hand_written_layers.py); now ``A`` is left out, as ``self.prototypes @ W`` is."""
    class MergedAdapter(nn.Module):
        def __init__(self):
            super().__init__()
            self.base = nn.Linear(8, 6).requires_grad_(False)
            self.B, self.A = nn.Parameter(torch.randn(6, 2)), nn.Parameter(torch.randn(2, 8))

        def forward(self, x):
            return F.linear(x, self.base.weight + scaled(self.B) @ self.A, self.base.bias)

    model = nn.Sequential(MergedAdapter(), nn.Tanh(), nn.Linear(6, 3))
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 6
    with pytest.warns(UserWarning, match="left the bare parameter"):
        _pass(tracker, model, torch.randn(6, 8), torch.randn(6, 3))
    assert "0.A" in tracker.excluded_reasons and "0.B" in tracker.excluded_reasons


@pytest.mark.parametrize("table", [lambda p: F.normalize(p, dim=-1), lambda p: 2 * F.normalize(p, dim=1),
                                   lambda p: F.normalize(p.view(6, 2, 4), dim=-1)],
                         ids=["normalized", "2 * normalized", "normalized 3-D"])
def test_a_normalized_table_is_computed_from_parameters(table):
    """``F.normalize(self.prototypes, dim=-1)`` expands each row's norm, ``(N, 1)`` to ``(N, D)``: an expand that
    makes no rows, walked through. Before, the walk stopped at it, and a plain loop at its defaults read the table's
    rows as examples (tests/trust/test_hand_written_layers.py)."""
    assert matmul_module.computed_from_parameters(table(nn.Parameter(torch.randn(6, 8))))


@pytest.mark.parametrize("rows", [lambda p: p.expand(6, -1, -1), lambda p: p[None].expand(6, -1, -1),
                                  lambda p: p[:, None].expand(-1, 6, -1), lambda p: p[:1].expand(6, -1),
                                  lambda p: F.normalize(p[None].expand(6, -1, -1), dim=-1)],
                         ids=["latents.expand(B, L, D)", "latents[None].expand", "sequence first", "one row to B",
                              "normalized after the expand"])
def test_an_expand_that_makes_rows_still_stops_the_walk(rows):
    """Learned queries expanded to the batch (a Perceiver's ``latents.expand(B, L, D)``, here with as many latents
    as the batch) have one copy per example: not a table, read as examples, as before."""
    assert not matmul_module.computed_from_parameters(rows(nn.Parameter(torch.randn(6, 8))))


@pytest.mark.parametrize("rows", [lambda x, p: x * 2, lambda x, p: torch.randn(x.shape[0], 1) * p,
                                  lambda x, p: p.expand(x.shape[0], -1) * 2], ids=["data * 2", "data-scaled table",
                                                                                   "expanded table"])
def test_rows_that_carry_the_examples_are_not_taken_for_parameters(rows):
    """The examples reach the rows through the data, a data operand, or an expand: read as examples, as before."""
    p, w = nn.Parameter(torch.randn(1, 4)), nn.Parameter(torch.randn(4, 3))
    x = torch.randn(5, 4, requires_grad=True)
    out = rows(x * 1, p) @ w
    assert not matmul_module.rows_are_parameter(out.grad_fn)
