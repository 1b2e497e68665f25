from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import linear_sq_norms, prefers_gram, sequence_sq_norms


def _check(module: nn.Linear, x: torch.Tensor, reference_sq_norms) -> None:
    weights = torch.randn_like(module(x))
    got = linear_sq_norms(module, x, weights)
    assert got.shape == (x.shape[0],)
    torch.testing.assert_close(got, reference_sq_norms(module, x, weights), rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("batch", "in_features", "out_features"), [(5, 4, 3), (1, 7, 2), (6, 1, 1)])
def test_linear_2d(batch: int, in_features: int, out_features: int, bias: bool, reference_sq_norms) -> None:
    module = nn.Linear(in_features, out_features, bias=bias).double()
    _check(module, torch.randn(batch, in_features, dtype=torch.float64), reference_sq_norms)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("seq_len", "in_features", "out_features", "gram"),
    [(2, 8, 8, True), (3, 16, 5, True), (10, 3, 4, False), (6, 4, 4, False)],
)
def test_linear_sequence_both_paths(
    seq_len: int, in_features: int, out_features: int, gram: bool, bias: bool, reference_sq_norms
) -> None:
    assert prefers_gram(seq_len, in_features, out_features) is gram
    module = nn.Linear(in_features, out_features, bias=bias).double()
    _check(module, torch.randn(4, seq_len, in_features, dtype=torch.float64), reference_sq_norms)


def test_linear_several_middle_dims(reference_sq_norms) -> None:
    module = nn.Linear(5, 3).double()
    _check(module, torch.randn(3, 2, 4, 5, dtype=torch.float64), reference_sq_norms)


def test_frozen_weight_trainable_bias(reference_sq_norms) -> None:
    module = nn.Linear(4, 3).double()
    module.weight.requires_grad_(False)
    _check(module, torch.randn(5, 4, dtype=torch.float64), reference_sq_norms)
    _check(module, torch.randn(5, 3, 4, dtype=torch.float64), reference_sq_norms)


def test_frozen_bias_trainable_weight(reference_sq_norms) -> None:
    module = nn.Linear(4, 3).double()
    module.bias.requires_grad_(False)
    _check(module, torch.randn(5, 3, 4, dtype=torch.float64), reference_sq_norms)


def test_param_names_restricts_measured_params(reference_sq_norms) -> None:
    module = nn.Linear(4, 3).double()
    x = torch.randn(5, 2, 4, dtype=torch.float64)
    weights = torch.randn(5, 2, 3, dtype=torch.float64)
    got = linear_sq_norms(module, x, weights, param_names={"bias"})
    torch.testing.assert_close(got, reference_sq_norms(module, x, weights, param_names={"bias"}))


def test_prefers_gram_compares_costs() -> None:
    assert prefers_gram(1, 3, 3) is True  # T²·(K+L+1) = 7 < (T+1)·K·L = 18
    assert prefers_gram(64, 128, 128) is True  # 1,052,672 < 1,064,960: the reductions tip the balance
    assert prefers_gram(2, 2, 2) is False  # 20 > 12
    assert prefers_gram(1, 1, 2) is False  # 4 == 4: a tie materialises
    assert prefers_gram(100, 64, 64) is False
    assert prefers_gram(10, 512, 512) is True


@pytest.mark.parametrize(("seq_len", "in_features", "out_features"), [(2, 9, 7), (12, 2, 3)])
def test_sequence_sq_norms_matches_materialised(seq_len: int, in_features: int, out_features: int) -> None:
    activations = torch.randn(3, seq_len, in_features, dtype=torch.float64)
    grads = torch.randn(3, seq_len, out_features, dtype=torch.float64)
    expected = torch.einsum("ntk,ntl->nkl", activations, grads).square().sum(dim=(1, 2))
    torch.testing.assert_close(sequence_sq_norms(activations, grads), expected)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_inputs_give_float32(dtype: torch.dtype) -> None:
    module = nn.Linear(4, 3)
    x = torch.randn(5, 2, 4)
    grads = torch.randn(5, 2, 3)
    got = linear_sq_norms(module, x.to(dtype), grads.to(dtype))
    assert got.dtype == torch.float32
    expected = linear_sq_norms(module, x.to(dtype).float(), grads.to(dtype).float())
    torch.testing.assert_close(got, expected)


def test_unbatched_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch"):
        linear_sq_norms(nn.Linear(4, 3), torch.randn(4), torch.randn(3))
