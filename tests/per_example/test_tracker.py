from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.own_hooks import inert_hook
from gns_callback.per_example import tracker as tracker_module
from tests.helpers import LearnedSlope, module_hooks, package_objects_reachable

from .conftest import per_example_sq_norms_reference

BATCH = 4


class Scale(nn.Module):
    """Unsupported module holding a bare parameter."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def make_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 8),
        nn.ReLU(inplace=True),
        nn.Linear(8, 6, bias=False),
        LearnedSlope(),
        Scale(6),
        nn.Linear(6, 3),
    ).double()


def make_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, groups=2, padding=1, padding_mode="reflect"),
        nn.GroupNorm(3, 6),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 2),
    ).double()


class TokenModel(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.LayerNorm(dim)
        self.mixer = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.mixer(self.norm(self.embedding(tokens))).relu()
        return self.head(hidden.mean(dim=1))


def make_token_model() -> nn.Module:
    return TokenModel().double()


def token_inputs() -> torch.Tensor:
    return torch.randint(11, (BATCH, 7))


MODELS = {
    "mlp": (make_mlp, lambda: torch.randn(BATCH, 5, dtype=torch.float64)),
    "cnn": (make_cnn, lambda: torch.randn(BATCH, 3, 6, 6, dtype=torch.float64)),
    "tokens": (make_token_model, token_inputs),
}


def covered_names(model: nn.Module, tracker: PerExampleNormTracker) -> set[str]:
    covered = {id(param) for param in tracker.covered_parameters()}
    return {name for name, param in model.named_parameters() if id(param) in covered}


def run_backward(model: nn.Module, inputs: torch.Tensor, weights: torch.Tensor, mean: bool = False) -> None:
    loss = (model(inputs) * weights).sum()
    (loss / inputs.shape[0] if mean else loss).backward()


def expected_sq_norms(model: nn.Module, tracker: PerExampleNormTracker, inputs, weights) -> torch.Tensor:
    return per_example_sq_norms_reference(model, inputs, weights, covered_names(model, tracker)).float()


@pytest.mark.parametrize("name", list(MODELS))
def test_totals_match_torch_func(name: str) -> None:
    make_model, make_inputs = MODELS[name]
    model, inputs = make_model(), make_inputs()
    weights = torch.randn_like(model(inputs))
    with PerExampleNormTracker(model) as tracker:
        run_backward(model, inputs, weights)
        got = tracker.pop()
    assert got is not None and got.dtype == torch.float32 and got.shape == (BATCH,)
    torch.testing.assert_close(got, expected_sq_norms(model, tracker, inputs, weights), rtol=1e-4, atol=0)


def test_mean_loss_is_not_rescaled() -> None:
    model, inputs = make_mlp(), torch.randn(BATCH, 5, dtype=torch.float64)
    weights = torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        run_backward(model, inputs, weights, mean=True)
        got = tracker.pop()
    expected = expected_sq_norms(model, tracker, inputs, weights) / BATCH**2
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)


def test_passes_accumulate_until_pop() -> None:
    model, inputs = make_token_model(), token_inputs()
    weights = torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        run_backward(model, inputs, weights)
        run_backward(model, inputs, weights)
        twice = tracker.pop()
        assert tracker.pop() is None
    expected = 2 * expected_sq_norms(model, tracker, inputs, weights)
    torch.testing.assert_close(twice, expected, rtol=1e-4, atol=0)


def test_coverage_of_mlp_with_unsupported_modules() -> None:
    model = make_mlp()
    tracker = PerExampleNormTracker(model)
    uncovered = dict(tracker.uncovered_parameters())
    assert set(uncovered) == {"3.weight", "4.scale"}
    assert set(tracker.excluded_reasons) == set(uncovered)
    assert "LearnedSlope" in tracker.excluded_reasons["3.weight"]
    assert covered_names(model, tracker) == {"0.weight", "0.bias", "2.weight", "5.weight", "5.bias"}
    covered_numel = 5 * 8 + 8 + 8 * 6 + 6 * 3 + 3
    assert tracker.coverage_fraction() == pytest.approx(covered_numel / (covered_numel + 1 + 6))


def test_extra_parameter_on_supported_module_is_not_covered() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    model[0].adapter = nn.Parameter(torch.zeros(2, 3))
    tracker = PerExampleNormTracker(model)
    assert [name for name, _ in tracker.uncovered_parameters()] == ["0.adapter"]
    assert "adapter" in tracker.excluded_reasons["0.adapter"]
    assert tracker.coverage_fraction() == pytest.approx(8 / 14)


def test_frozen_parameters_are_ignored() -> None:
    model = make_token_model()
    model.embedding.weight.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    inputs, weights = token_inputs(), torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        assert covered_names(model, tracker) == {
            "norm.weight", "norm.bias", "mixer.weight", "mixer.bias", "head.weight"
        }
        assert tracker.coverage_fraction() == 1.0
        assert model.embedding._forward_hooks == {}
        run_backward(model, inputs, weights)
        got = tracker.pop()
    torch.testing.assert_close(got, expected_sq_norms(model, tracker, inputs, weights), rtol=1e-4, atol=0)


def test_detach_leaves_no_hooks() -> None:
    model = make_cnn()
    tracker = PerExampleNormTracker(model).attach()
    assert any(module._forward_hooks for module in model.modules())
    tracker.detach()
    assert all(not module._forward_hooks for module in model.modules())
    assert all(not param._backward_hooks for param in model.parameters())
    inputs = torch.randn(BATCH, 3, 6, 6, dtype=torch.float64)
    model(inputs).sum().backward()
    assert tracker.pop() is None


def make_encoder() -> nn.Module:
    """Attention (a forward pre-hook and a forward hook run however the forward ends), Linear and LayerNorm."""
    torch.manual_seed(0)
    return nn.TransformerEncoderLayer(6, 2, dim_feedforward=8, dropout=0.0, batch_first=True).double()


COPIED = {"mlp": MODELS["mlp"], "encoder": (make_encoder, lambda: torch.randn(BATCH, 3, 6, dtype=torch.float64))}


@pytest.mark.parametrize("name", list(COPIED))
def test_a_copy_of_the_model_carries_no_live_hook_and_no_tracker(name: str) -> None:
    """``copy.deepcopy(model)`` while the hooks are on (an EMA copy, ``AveragedModel(model)``): the copy's hooks are
    inert, it refers to no tracker, its passes record nothing, and the model is measured as before. Before, the
    copy's hooks were bound to a copy of the tracker (and of its whole ``.model``, a LightningModule in a fit), and
    measured the copy for good."""
    make_model, make_inputs = COPIED[name]
    model, inputs = make_model(), make_inputs()
    weights = torch.randn_like(model(inputs))
    with PerExampleNormTracker(model) as tracker:
        copied = copy.deepcopy(model)
        assert package_objects_reachable(copied) == []
        assert module_hooks(copied) and all(hook is inert_hook for hook in module_hooks(copied))
        run_backward(copied, inputs, weights)
        assert tracker.pop() is None
        run_backward(model, inputs, weights)
        got = tracker.pop()
        torch.testing.assert_close(copied(inputs), model(inputs), rtol=0, atol=0)
    torch.testing.assert_close(got, expected_sq_norms(model, tracker, inputs, weights), rtol=1e-4, atol=0)
    assert module_hooks(model) == [] and module_hooks(copied) != []  # the copy's inert hooks are not the tracker's


def test_pickling_the_model_pickles_no_tracker() -> None:
    """``torch.save(model)`` (or ``pickle``) while the hooks are on: the tracker is not pickled, and the loaded
    model runs with inert hooks. Before, the bound hooks pickled the tracker (and its model) along."""
    model, inputs = make_mlp(), torch.randn(BATCH, 5, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        data = pickle.dumps(model)
        assert b"PerExampleNormTracker" not in data
        loaded = pickle.loads(data)
        assert package_objects_reachable(loaded) == []
        loaded(inputs).sum().backward()
        assert tracker.pop() is None
        torch.testing.assert_close(loaded(inputs), model(inputs), rtol=0, atol=0)
        model(inputs).sum().backward()
        assert tracker.pop() is not None


def test_hooks_on_live_outputs_go_inert_after_detach() -> None:
    model, inputs = make_mlp(), torch.randn(BATCH, 5, dtype=torch.float64)
    tracker = PerExampleNormTracker(model).attach()
    out = model(inputs)
    tracker.detach()
    out.sum().backward()
    assert tracker.pop() is None


def test_disabled_tracker_does_no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    model, inputs = make_mlp(), torch.randn(BATCH, 5, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        calls = []
        monkeypatch.setattr(tracker, "_on_output_grad", lambda *args: calls.append(args))
        tracker.enabled = False
        model(inputs).sum().backward()
        assert tracker.pop() is None
        assert calls == []

        tracker.enabled = True
        out = model(inputs)  # hooks placed while enabled ...
        tracker.enabled = False
        out.sum().backward()  # ... do nothing once disabled
        assert tracker.pop() is None


def test_no_grad_forward_is_ignored() -> None:
    model, inputs = make_mlp(), torch.randn(BATCH, 5, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        with torch.no_grad():
            model(inputs)
        assert tracker.pop() is None


class TiedModel(nn.Module):
    """A language model's tied input and output embeddings (``decoder.weight = embedding.weight``). ``pool``: the
    head sees one vector per example (2-D input) instead of every position; ``padding_idx``: token 0 pads."""

    def __init__(self, pool: bool = False, padding_idx: int | None = None) -> None:
        super().__init__()
        self.embedding = nn.Embedding(9, 4, padding_idx=padding_idx)
        self.mixer = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 9)
        self.decoder.weight = self.embedding.weight
        self.pool = pool

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mixer(self.embedding(tokens)))
        return self.decoder(h.mean(1) if self.pool else h)


class HeadFirst(nn.Module):
    """The tied Linear runs before the lookup in the forward, so the embedding's gradient arrives first."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.decoder, self.mix = nn.Embedding(9, 4), nn.Linear(4, 9, bias=False), nn.Linear(4, 9)
        self.decoder.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.decoder(tokens[:, :4].to(self.decoder.weight.dtype) / 9.0)
        return logits + self.mix(self.embedding(tokens).mean(1))


@pytest.mark.parametrize("model", [TiedModel(), TiedModel(pool=True), TiedModel(padding_idx=0), HeadFirst()],
                         ids=["per-position head", "pooled head", "padding_idx", "head first"])
def test_a_table_tied_between_an_embedding_and_a_linear_is_measured_exactly(model: nn.Module) -> None:
    """The tied table's per-example gradient is the sum of both uses: its norm is each use's plus twice their
    inner product (:mod:`gns_callback.per_example.tied`), against torch.func over every parameter."""
    torch.manual_seed(0)
    model = model.double()
    tracker = PerExampleNormTracker(model, max_examples=2)  # a subset is never measured with a tied table
    assert tracker.excluded_reasons == {} and tracker.coverage_fraction() == 1.0
    tokens = torch.randint(9, (BATCH, 5))
    weights = torch.randn_like(model(tokens))
    with tracker:
        run_backward(model, tokens, weights)
        got = tracker.pop()
    expected = per_example_sq_norms_reference(model, tokens, weights)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=0)


def test_a_table_shared_by_two_linears_is_excluded_with_reason() -> None:
    class SharedLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)
            self.second.weight = self.first.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.tanh(self.first(x)))

    model = SharedLinear().double()
    tracker = PerExampleNormTracker(model)
    assert set(tracker.excluded_reasons) == {"first.weight"}
    reason = tracker.excluded_reasons["first.weight"]
    assert "first.weight" in reason and "second.weight" in reason
    assert covered_names(model, tracker) == {"first.bias", "second.bias"}
    inputs = torch.randn(BATCH, 4, dtype=torch.float64)
    weights = torch.randn(BATCH, 4, dtype=torch.float64)
    with tracker:
        run_backward(model, inputs, weights)
        got = tracker.pop()
    torch.testing.assert_close(got, expected_sq_norms(model, tracker, inputs, weights), rtol=1e-4, atol=0)


def test_module_registered_under_two_names_is_covered_once() -> None:
    model = nn.Sequential()
    shared = nn.Linear(3, 3)
    model.add_module("first", shared)
    model.add_module("alias", nn.Identity())
    model.alias = shared
    tracker = PerExampleNormTracker(model)
    assert tracker.excluded_reasons == {}
    assert len(tracker.covered_parameters()) == 2


def test_a_convolution_applied_twice_is_reported_at_pop() -> None:
    """A convolution's calls can't be read as one (:mod:`gns_callback.per_example.repeated`)."""
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Conv1d(3, 3, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.inner(x.unsqueeze(-1))).squeeze(-1)

    model = nn.Sequential(nn.Linear(3, 3), Twice()).double()
    with PerExampleNormTracker(model) as tracker:
        out = model(torch.randn(BATCH, 3, dtype=torch.float64))
        out.sum().backward()  # never raises inside the user's backward: the failure is reported at pop
        with pytest.raises(RuntimeError, match=r"'1\.inner'.*micro_batch"):
            tracker.pop()
        # Calling a module once per backward pass (e.g. gradient accumulation) is fine.
        model[0](torch.randn(BATCH, 3, dtype=torch.float64)).sum().backward()
        model[0](torch.randn(BATCH, 3, dtype=torch.float64)).sum().backward()
        assert tracker.pop() is not None


def test_second_call_without_gradient_is_fine() -> None:
    lin = nn.Linear(3, 3).double()
    inputs = torch.randn(BATCH, 3, dtype=torch.float64)
    weights = torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(lin) as tracker:
        with torch.no_grad():
            lin(inputs)
        unused = lin(inputs * 2)  # never backpropagated through
        (lin(inputs) * weights).sum().backward()
        got = tracker.pop()
    del unused
    expected = per_example_sq_norms_reference(lin, inputs, weights).float()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)


def test_functional_use_of_covered_weight_is_read_from_the_next_pass(reference_sq_norms) -> None:
    """``F.linear(h, self.head.weight, self.head.bias)``: the head's parameters are handed to the module that uses them
    (the first pass is dropped, with a warning) and read at their product from then on. Before, the pass failed."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(3, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(self.body(x), self.head.weight, self.head.bias)  # never calls self.head

    model = nn.Sequential(nn.Linear(3, 3), Functional()).double()
    x, weights = torch.randn(BATCH, 3, dtype=torch.float64), torch.randn(BATCH, 2, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        with pytest.warns(UserWarning, match="'1.head' are used outside its forward"):
            (model(x) * weights).sum().backward()
        assert tracker.pop_passes() == []
        model.zero_grad()
        (model(x) * weights).sum().backward()
        torch.testing.assert_close(tracker.pop().double(), reference_sq_norms(model, x, weights), rtol=1e-5, atol=0)
        assert tracker.coverage_fraction() == 1.0


def test_a_weight_pruned_after_attach_is_reported_at_pop() -> None:
    """``prune`` moves the Parameter to ``weight_orig`` and runs the layer on ``weight_orig * mask``: the layer's
    per-example gradients are no longer the parameter's (which are masked)."""
    import torch.nn.utils.prune as prune

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    with PerExampleNormTracker(model) as tracker:
        prune.l1_unstructured(model[0], "weight", amount=0.5)
        model(torch.randn(BATCH, 3, dtype=torch.float64)).sum().backward()
        with pytest.raises(RuntimeError, match=r"'0\.weight' is no longer its layer's own.*pruned"):
            tracker.pop()


def test_non_reentrant_activation_checkpointing() -> None:
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 4))
            self.head = nn.Linear(4, 2)
            self.use_checkpoint = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.use_checkpoint:
                return self.head(checkpoint(self.block, x, use_reentrant=False))
            return self.head(self.block(x))

    model = Checkpointed().double()
    inputs = torch.randn(BATCH, 3, 4, dtype=torch.float64)
    weights = torch.randn(BATCH, 3, 2, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        run_backward(model, inputs, weights)
        got = tracker.pop()
    model.use_checkpoint = False  # torch.func can't run through checkpointing
    torch.testing.assert_close(got, expected_sq_norms(model, tracker, inputs, weights), rtol=1e-4, atol=0)


def test_batch_size_mismatch_is_reported_at_pop() -> None:
    class Flattening(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(3, 3)
            self.second = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(self.first(x).reshape(-1, 3))  # tokens become "examples"

    model = Flattening().double()
    with PerExampleNormTracker(model) as tracker:
        out = model(torch.randn(BATCH, 5, 3, dtype=torch.float64))
        out.sum().backward()
        with pytest.raises(RuntimeError, match="batch size|rows, but the model was called on"):
            tracker.pop()


def test_has_batchnorm_in_training() -> None:
    tracker = PerExampleNormTracker(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)))
    assert tracker.has_batchnorm_in_training()
    assert not tracker.excluded_reasons  # measured; a step with it in training mode is refused by the meter
    tracker.model.eval()
    assert not tracker.has_batchnorm_in_training()
    assert not PerExampleNormTracker(make_mlp()).has_batchnorm_in_training()
    sync_bn = nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2))
    assert PerExampleNormTracker(sync_bn).has_batchnorm_in_training()


def test_a_failure_in_a_pass_that_does_not_fill_grad_is_dropped() -> None:
    """An ``autograd.grad`` pass over a batch of another size (e.g. a saliency map on a probe batch) finds the
    layout wrong; it never reaches ``.grad``, so it must not stop the measurement of the real backward pass."""
    lin = nn.Linear(3, 3).double()
    inputs = torch.randn(BATCH, 3, dtype=torch.float64)
    weights = torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(lin) as tracker:
        tracker.expected_batch_size = BATCH
        other = torch.randn(BATCH + 3, 3, dtype=torch.float64, requires_grad=True)
        torch.autograd.grad(lin(other).sum(), other)
        (lin(inputs) * weights).sum().backward()
        got = tracker.pop()
    expected = per_example_sq_norms_reference(lin, inputs, weights).float()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=0)


def test_sequence_first_input_is_measured_along_dim_1() -> None:
    """``(T, B, D)`` into a Linear: per-example norms of the B examples, equal to the batch-first computation."""
    lin = nn.Linear(3, 2).double()
    inputs = torch.randn(BATCH, 5, 3, dtype=torch.float64)
    weights = torch.randn(BATCH, 5, 2, dtype=torch.float64)
    with PerExampleNormTracker(lin) as tracker:
        (lin(inputs) * weights).sum().backward()
        batch_first = tracker.pop()
        tracker.expected_batch_size = BATCH
        (lin(inputs.transpose(0, 1)) * weights.transpose(0, 1)).sum().backward()
        sequence_first = tracker.pop()
    torch.testing.assert_close(sequence_first, batch_first, rtol=1e-6, atol=0)
    assert sequence_first.shape == (BATCH,)


class SequenceFirstEncoder(nn.Module):
    """Tokens (T, B) through an embedding, a sequence-first encoder layer (or Linear layers only, turned to (T, B, ·)
    by hand, with no ``batch_first`` flag anywhere) and a head on the mean over positions."""

    def __init__(self, flagged: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(9, 8)
        self.body = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0) if flagged else nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embedding(tokens))).mean(0))


@pytest.mark.parametrize("flagged", [True, False])
def test_a_batch_as_long_as_it_is_wide_is_read_along_the_dim_seen_before(flagged) -> None:
    """Sequences of varying length in a sequence-first model: a batch of T = B tokens can't be told by its shapes;
    read the way earlier batches of other lengths were. Before, it stopped the measurement of a flagged model for the
    rest of the run, and read a hand-written one along its positions. Reference: each example's own backward."""
    torch.manual_seed(0)
    model = SequenceFirstEncoder(flagged).double()
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 5
    for length in (4, 5):
        tokens, weights = torch.randint(9, (length, 5)), torch.randn(5, 3, dtype=torch.float64)
        (model(tokens) * weights).sum().backward()
        got = tracker.pop().double()
        model.zero_grad()
        expected = []
        for i in range(5):
            grads = torch.autograd.grad((model(tokens[:, i:i + 1]) * weights[i:i + 1]).sum(), list(model.parameters()))
            expected.append(sum(g.pow(2).sum() for g in grads))
        torch.testing.assert_close(got, torch.stack(expected), rtol=1e-6, atol=0)
    tracker.detach()


@pytest.mark.parametrize("factory, shape", [(make_mlp, (7, 5)), (make_cnn, (7, 3, 6, 6))])
def test_a_subset_pass_records_the_unmeasured_examples_summed_gradient(factory, shape, monkeypatch) -> None:
    """With ``max_examples`` below the batch, the pass also holds ``|Σ_{i unmeasured} g_i|²`` over the covered
    parameters: brute force from per-example gradients (a subset forced even where measuring all is cheaper)."""
    monkeypatch.setattr(tracker_module, "subset_is_cheaper", lambda *args: True)
    model = factory()
    inputs = torch.randn(shape, dtype=torch.float64)
    tracker = PerExampleNormTracker(model, max_examples=3).attach()
    out = model(inputs)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (record,) = tracker.pop_passes()
    covered = {name for name, p in model.named_parameters() if any(p is q for q in tracker.covered_parameters())}
    rest = torch.stack([per_example_vector(model, inputs[i], weights[i], covered) for i in range(3, shape[0])])
    assert record.sq_norms.shape == (3,)
    assert record.unmeasured_sq.item() == pytest.approx(rest.sum(0).square().sum().item(), rel=1e-5)
    assert not record.subset_grads


@pytest.mark.parametrize("max_examples", [7, 3])
def test_every_example_measured_records_no_unmeasured_block(max_examples: int) -> None:
    """A batch no larger than ``max_examples``, or a model whose norms are cheaper than a subset's summed gradient
    (plain Linear layers), measures every example."""
    model = make_mlp()
    tracker = PerExampleNormTracker(model, max_examples=max_examples).attach()
    model(torch.randn(7, 5, dtype=torch.float64)).sum().backward()
    (record,) = tracker.pop_passes()
    assert record.sq_norms.shape == (7,)
    assert record.unmeasured_sq is None and not record.subset_grads


def test_a_convolution_measures_the_subset_where_it_is_cheaper() -> None:
    model = make_cnn()
    tracker = PerExampleNormTracker(model, max_examples=3).attach()
    model(torch.randn(16, 3, 6, 6, dtype=torch.float64)).sum().backward()
    (record,) = tracker.pop_passes()
    assert record.subset and record.sq_norms.shape == (3,) and record.unmeasured_sq is not None


def per_example_vector(model: nn.Module, x: torch.Tensor, weight: torch.Tensor, names: set[str]) -> torch.Tensor:
    """One example's gradient of ``(model(x)·weight).sum()`` over the parameters ``names``, flattened."""
    params = [p for n, p in model.named_parameters() if n in names]
    grads = torch.autograd.grad((model(x.unsqueeze(0)) * weight.unsqueeze(0)).sum(), params)
    return torch.cat([g.reshape(-1) for g in grads])



class SharedPositions(nn.Module):
    """nanoGPT's pattern: ``wpe(torch.arange(T))``, one position table broadcast over the batch (24 of 123 trainable
    parameters at the defaults; 24 of 474 with ``vocab=50``)."""

    def __init__(self, vocab: int = 11, seq: int = 6, d: int = 4) -> None:
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(vocab, d), nn.Embedding(seq, d), nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))


@pytest.mark.parametrize("vocab", [11, 50])
@pytest.mark.parametrize("batch", [6, 4])
def test_a_shared_position_table_is_read_at_its_broadcast_even_when_its_length_equals_the_batch(vocab, batch):
    """With T == B the table's (T, d) output gradient looks like a batch of T examples: reading it as one would give
    wrong per-example norms. It is read where its rows are broadcast over the batch instead (as a bare parameter
    of the module calling it): the norms are the brute-force ones over every parameter, at any batch size and
    whatever its share (20% or 5%), with no warning. Before, it was left out (5%) or the pass refused (20%)."""
    torch.manual_seed(0)
    net = SharedPositions(vocab=vocab).double()
    tracker = PerExampleNormTracker(net).attach()
    tokens, weights = torch.randint(0, vocab, (batch, 6)), torch.randn(batch, 6, vocab, dtype=torch.float64)
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (net(tokens) * weights).sum().backward()
        (record,) = tracker.pop_passes()
        expected = per_example_sq_norms_reference(net, tokens, weights)
        torch.testing.assert_close(record.sq_norms.double(), expected, rtol=1e-6, atol=0)  # summed in float32
        assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons
        net.zero_grad()
    tracker.attach()  # re-attaching decides coverage afresh: the table is a layer again until its next forward
    assert len(tracker.covered_parameters()) == 4


class SequenceFirstTied(nn.Module):
    """A tied table in a sequence-first model: tokens (T, B), every activation (T, B, ·)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding, self.mixer, self.decoder = nn.Embedding(9, 4), nn.Linear(4, 4), nn.Linear(4, 9)
        self.decoder.weight = self.embedding.weight
        self.marker = nn.Module()
        self.marker.batch_first = False  # what nn.TransformerEncoderLayer() declares by default

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.mixer(self.embedding(tokens))))


def test_a_tied_table_in_a_sequence_first_model_is_measured_exactly() -> None:
    """Batch 5 in dim 1 of tokens (T = 6); reference: each example's gradient by its own backward pass."""
    torch.manual_seed(0)
    model = SequenceFirstTied().double()
    tokens, weights = torch.randint(9, (6, 5)), torch.randn(6, 5, 9, dtype=torch.float64)
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 5
    (model(tokens) * weights).sum().backward()
    got = tracker.pop().double()
    tracker.detach()
    expected = []
    for i in range(5):
        grads = torch.autograd.grad((model(tokens[:, i:i + 1]) * weights[:, i:i + 1]).sum(), list(model.parameters()))
        expected.append(sum(g.pow(2).sum() for g in grads))
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-6, atol=0)


@pytest.mark.parametrize("decoder_tokens, tied_head", [(5, False), (0, False), (5, True), (12, True)],
                         ids=["encoder and decoder tables", "the decoder's never called", "a tied head too",
                              "a tied head, the decoder as long as the encoder"])
def test_embeddings_sharing_one_table_are_one_table_looked_up_several_times(decoder_tokens: int,
                                                                            tied_head: bool) -> None:
    """T5's ``shared``, ``encoder.embed_tokens`` and ``decoder.embed_tokens`` hold one weight: each example's
    gradient of it is the sum over every position of every lookup, as for one embedding called twice. With a tied
    output layer too (BART, T5 v1.0), the head's part is added and the cross term pairs it with the lookups of every
    call. Before, the table was left out ("shared by several modules"), and in T5 it is the largest parameter."""
    from tests.trust.models import SharedTables

    model = SharedTables(decoder_tokens, tied_head=tied_head)
    tokens, weights = torch.randint(0, 17, (6, 12)), torch.randn(6, 10)
    tracker = PerExampleNormTracker(model).attach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            model.zero_grad()
            (model(tokens) * weights).sum().backward()
            torch.testing.assert_close(tracker.pop(), per_example_sq_norms_reference(model, tokens, weights).float(),
                                       rtol=1e-5, atol=0)
    assert tracker.coverage_fraction() == 1.0 and not tracker.excluded_reasons


def test_embeddings_sharing_a_table_with_other_options_stay_left_out() -> None:
    """Tables looked up with different ``padding_idx`` are not one module's calls."""
    from tests.trust.models import SharedTables

    model = SharedTables()
    model.decoder.padding_idx = 0
    tracker = PerExampleNormTracker(model).attach()
    assert "shared by several modules" in tracker.excluded_reasons["shared.weight"]


class FlattenedRows(nn.Module):
    """Token embeddings flattened to ``(B·T, D)`` rows (``h.view(-1, D)``, as hand-written mixture-of-experts and
    older language-model code do) through a Linear and a LayerNorm, viewed back, pooled to a head. ``sequence_first``:
    the rows flattened from ``(T, B, D)`` instead."""

    def __init__(self, sequence_first: bool = False) -> None:
        super().__init__()
        self.embed, self.proj, self.norm = nn.Embedding(11, 6), nn.Linear(6, 6), nn.LayerNorm(6)
        self.head, self.sequence_first = nn.Linear(6, 3), sequence_first

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens.t() if self.sequence_first else tokens)
        rows = self.norm(torch.tanh(self.proj(h.reshape(-1, 6))))
        h = rows.view(h.shape)
        return self.head((h.transpose(0, 1) if self.sequence_first else h).mean(1))


@pytest.mark.parametrize("sequence_first", [False, True], ids=["(B, T)", "(T, B)"])
def test_rows_flattened_from_the_examples_are_read_per_example(sequence_first: bool) -> None:
    """Before, dim 0 of ``(B·T, D)`` holding no batch stopped the measurement (the layer's rows looked like no
    examples); a view saves the shape it was taken from, and each example's rows are read there."""
    model = FlattenedRows(sequence_first).double()
    tokens = torch.randint(0, 11, (BATCH, 3))
    weights = torch.randn(BATCH, 3, dtype=torch.float64)
    with PerExampleNormTracker(model) as tracker:
        tracker.expected_batch_size = BATCH
        (model(tokens) * weights).sum().backward()
        got = tracker.pop()
        assert tracker.coverage_fraction() == 1.0
    expected = per_example_sq_norms_reference(model, tokens, weights).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_flattened_rows_of_unknown_batch_size_still_stop_the_measurement() -> None:
    """Without the batch's size the rows are not unflattened (not guessed): read as a batch of B·T, they disagree
    with the head's batch of B, and the pass is refused."""
    model = FlattenedRows().double()
    with PerExampleNormTracker(model) as tracker:
        tracker.expected_batch_size = None
        model(torch.randint(0, 11, (BATCH, 3))).sum().backward()
        with pytest.raises(RuntimeError, match="saw batch size 12 but .head. saw 4|ran on 12 rows, but the model was "
                                                "called on 4 examples"):
            tracker.pop()


def test_hugging_face_t5_with_its_tied_head_is_measured_exactly() -> None:
    """``T5ForConditionalGeneration`` with ``tie_word_embeddings``: ``shared``, both stacks' ``embed_tokens`` and
    ``lm_head`` hold one table, now measured (before, left out: 27% of t5-small's parameters). Only the relative
    attention biases, read nowhere per example here (shared buckets used through an unsqueeze), stay out."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(vocab_size=17, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                   dropout_rate=0.0, relative_attention_num_buckets=8, tie_word_embeddings=True,
                                   decoder_start_token_id=0, pad_token_id=0)
    t5 = transformers.T5ForConditionalGeneration(config)

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.t5 = t5

        def forward(self, tokens):
            return self.t5(input_ids=tokens, decoder_input_ids=tokens[:, :6]).logits

    model = Logits().double()
    tokens, weights = torch.randint(3, 16, (5, 10)), torch.randn(5, 6, 17, dtype=torch.float64)
    tracker = PerExampleNormTracker(model).attach()
    tracker.expected_batch_size = 5
    (model(tokens) * weights).sum().backward()
    got = tracker.pop()
    assert "t5.shared.weight" not in tracker.excluded_reasons
    assert all("relative_attention_bias" in name for name in tracker.excluded_reasons)
    covered = {name for name, param in model.named_parameters() if any(param is p for p in tracker.covered_parameters())}
    expected = per_example_sq_norms_reference(model, tokens, weights, param_names=covered).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
