"""``nn.MultiheadAttention`` (its projections applied functionally) against per-example backward passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.attention import ProjectionCalls

BATCH, LENGTH, DIM = 3, 5, 8


class Attention(nn.Module):
    """Attention then a Linear head; ``mode`` picks the path through ``F.multi_head_attention_forward``."""

    def __init__(self, mode: str = "self", batch_first: bool = True, need_weights: bool = False, **options) -> None:
        super().__init__()
        self.mode, self.batch_first, self.need_weights = mode, batch_first, need_weights
        self.attention = nn.MultiheadAttention(DIM, 2, batch_first=batch_first, **options)
        self.memory = nn.Linear(DIM, options.get("kdim") or DIM)
        self.values = nn.Linear(DIM, options.get("vdim") or DIM)
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "self":
            key = value = x
        elif self.mode == "cross":  # key is value, query differs
            key = value = self.memory(x.flip(1 if self.batch_first else 0))
        else:  # three different tensors
            key, value = self.memory(x), self.values(x.flip(1 if self.batch_first else 0))
        out = self.attention(x, key, value, need_weights=self.need_weights)[0]
        return self.head(out)


def per_example_reference(model: nn.Module, inputs: torch.Tensor, weights: torch.Tensor, batch_dim: int,
                          names: set[str]) -> torch.Tensor:
    """``Σ |∇ (model(x_i)·R_i).sum()|²`` over the parameters ``names``, one backward pass per example."""
    params = {name: p for name, p in model.named_parameters() if name in names}
    norms = []
    for i in range(inputs.shape[batch_dim]):
        x, w = inputs.narrow(batch_dim, i, 1), weights.narrow(batch_dim, i, 1)
        grads = torch.autograd.grad((model(x) * w).sum(), list(params.values()), allow_unused=True)
        norms.append(sum(g.double().square().sum() for g in grads if g is not None))
    return torch.stack(norms)


def covered(model: nn.Module, tracker: PerExampleNormTracker) -> set[str]:
    ids = {id(p) for p in tracker.covered_parameters()}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def measure(model: nn.Module, inputs: torch.Tensor, batch_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(tracker's per-example squared norms, the reference over the parameters it covers)."""
    weights = torch.randn_like(model(inputs))
    with PerExampleNormTracker(model) as tracker:
        tracker.expected_batch_size = inputs.shape[batch_dim]
        (model(inputs) * weights).sum().backward()
        got = tracker.pop()
        names = covered(model, tracker)
    return got, per_example_reference(model, inputs, weights, batch_dim, names).float()


CASES = {
    "self-attention, packed projection": dict(mode="self"),
    "self-attention, attention weights returned": dict(mode="self", need_weights=True),
    "cross-attention, key is value (split rows)": dict(mode="cross"),
    "key, value and query all differ (chunked rows)": dict(mode="kv"),
    "kdim and vdim differ (separate projection weights)": dict(mode="kv", kdim=6, vdim=4),
    "no biases": dict(mode="kv", bias=False),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("batch_first", [True, False])
def test_every_path_matches_per_example_backward_passes(case: str, batch_first: bool) -> None:
    model = Attention(batch_first=batch_first, **CASES[case]).double()
    shape = (BATCH, LENGTH, DIM) if batch_first else (LENGTH, BATCH, DIM)
    got, expected = measure(model, torch.randn(*shape, dtype=torch.float64), batch_dim=0 if batch_first else 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_the_whole_attention_module_is_covered() -> None:
    model = Attention(mode="kv", kdim=6, vdim=4)
    with PerExampleNormTracker(model) as tracker:
        assert {"attention.q_proj_weight", "attention.k_proj_weight", "attention.v_proj_weight",
                "attention.in_proj_bias", "attention.out_proj.weight", "attention.out_proj.bias"} <= covered(model,
                                                                                                          tracker)
        assert tracker.coverage_fraction() == 1.0


def test_add_bias_kv_leaves_out_only_the_extra_key_and_value() -> None:
    model = Attention(mode="self", add_bias_kv=True).double()
    with PerExampleNormTracker(model) as tracker:
        assert set(tracker.excluded_reasons) == {"attention.bias_k", "attention.bias_v"}
    got, expected = measure(model, torch.randn(BATCH, LENGTH, DIM, dtype=torch.float64))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_a_projection_shared_with_another_module_is_left_out_of_the_norms() -> None:
    """``out_proj.weight`` tied to another Linear is left out (a shared parameter); its projection's calls must not
    reach the norms either, or they would hold a parameter the big-batch norm does not."""

    class Shared(Attention):
        def __init__(self) -> None:
            super().__init__(mode="self")
            self.extra = nn.Linear(DIM, DIM)
            self.extra.weight = self.attention.out_proj.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(self.extra(x))

    model = Shared().double()
    with PerExampleNormTracker(model) as tracker:
        assert "attention.out_proj.weight" in tracker.excluded_reasons
    got, expected = measure(model, torch.randn(BATCH, LENGTH, DIM, dtype=torch.float64))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("batch_first", [True, False])
def test_a_transformer_encoder_layer_is_measured_whole(batch_first: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.TransformerEncoderLayer(DIM, 2, 16, dropout=0.0, batch_first=batch_first),
                          nn.Linear(DIM, 2)).double()
    with PerExampleNormTracker(model) as tracker:
        assert tracker.coverage_fraction() == 1.0
    shape = (BATCH, LENGTH, DIM) if batch_first else (LENGTH, BATCH, DIM)
    got, expected = measure(model, torch.randn(*shape, dtype=torch.float64), batch_dim=0 if batch_first else 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_the_forward_is_unchanged_and_f_linear_restored() -> None:
    model = Attention(mode="kv")
    inputs = torch.randn(BATCH, LENGTH, DIM)
    linear = F.linear
    plain = model(inputs)
    with PerExampleNormTracker(model):
        hooked = model(inputs)
        assert F.linear is linear
    assert torch.equal(plain, hooked)


def test_f_linear_is_restored_when_the_forward_raises() -> None:
    model = Attention(mode="self")
    linear = F.linear
    with PerExampleNormTracker(model):
        with pytest.raises(Exception):
            model(torch.randn(BATCH, LENGTH, DIM + 1))
        assert F.linear is linear


def test_a_capture_leaves_a_later_patch_in_place() -> None:
    linear = F.linear
    capture = ProjectionCalls(nn.MultiheadAttention(DIM, 2), {"in_proj_weight"}, lambda *args: None).__enter__()
    try:
        F.linear = theirs = lambda *args, **kwargs: linear(*args, **kwargs)
        capture.__exit__(None, None, None)
        assert F.linear is theirs
    finally:
        F.linear = linear


class Twice(Attention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        once = self.attention(x, x, x, need_weights=False)[0]
        return self.head(self.attention(once, once, once, need_weights=False)[0])


REFUSED = {  # name: (model, input shape, expected batch size, reason)
    "applied twice": (Twice, (BATCH, LENGTH, DIM), None, "applied more than once"),
    # a batch-first module fed (L, N, E): its "examples" would be positions
    "examples disagree with the batch": (Attention, (LENGTH, BATCH, DIM), BATCH,
                                         "holds 5 examples, but the batch has 3"),
    "unbatched query": (Attention, (LENGTH, DIM), None, "not batched"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_measured_is_refused_with_the_reason(case: str) -> None:
    make, shape, expected, reason = REFUSED[case]
    model = make()
    with PerExampleNormTracker(model) as tracker:
        tracker.expected_batch_size = expected
        model(torch.randn(*shape)).sum().backward()
        with pytest.raises(RuntimeError, match=reason):
            tracker.pop()


def test_a_disabled_tracker_leaves_f_linear_alone() -> None:
    model = Attention(mode="self")
    seen = []
    with PerExampleNormTracker(model) as tracker:
        tracker.enabled = False
        original = F.linear
        model.attention.register_forward_pre_hook(lambda *args: seen.append(F.linear is original))
        model(torch.randn(BATCH, LENGTH, DIM)).sum().backward()
        assert tracker.pop() is None
    assert seen == [True]


def test_non_reentrant_activation_checkpointing() -> None:
    """The forward runs again inside ``backward``; only the first forward's projections are measured."""

    class Checkpointed(Attention):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            attend = lambda h: self.attention(h, h, h, need_weights=False)[0]  # noqa: E731
            return self.head(checkpoint(attend, x, use_reentrant=False))

    model = Checkpointed().double()
    got, expected = measure(model, torch.randn(BATCH, LENGTH, DIM, dtype=torch.float64))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_under_bf16_autocast() -> None:
    """The projections run in bf16 under autocast; norms are computed in float32 from what the wrapper saw and
    agree with per-example backward passes under the same autocast to bf16's precision."""
    model = Attention(mode="cross")
    inputs = torch.randn(BATCH, LENGTH, DIM)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = measure(model, inputs)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=3e-2, atol=0)
