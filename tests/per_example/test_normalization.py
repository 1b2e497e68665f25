from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import group_norm_sq_norms, layer_norm_sq_norms, rms_norm_sq_norms
from gns_callback.per_example.normalization import batch_norm_sq_norms, batch_norm_summed_grads, instance_norm_sq_norms


def _check(fn, module: nn.Module, x: torch.Tensor, reference_sq_norms) -> None:
    weights = torch.randn_like(module(x))
    got = fn(module, x, weights)
    assert got.shape == (x.shape[0],)
    torch.testing.assert_close(got, reference_sq_norms(module, x, weights), rtol=1e-4, atol=1e-10)


def _non_trivial_affine(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for param in module.parameters():
            param.normal_()
    return module


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("normalized_shape", "input_shape"),
    [(6, (4, 6)), (6, (4, 3, 6)), ((3, 5), (4, 3, 5)), ((3, 5), (2, 4, 3, 5))],
)
def test_layer_norm(normalized_shape, input_shape: tuple[int, ...], bias: bool, reference_sq_norms) -> None:
    module = _non_trivial_affine(nn.LayerNorm(normalized_shape, bias=bias, eps=1e-3).double())
    _check(layer_norm_sq_norms, module, torch.randn(input_shape, dtype=torch.float64), reference_sq_norms)


def test_layer_norm_frozen_weight_trainable_bias(reference_sq_norms) -> None:
    module = _non_trivial_affine(nn.LayerNorm(5).double())
    module.weight.requires_grad_(False)
    _check(layer_norm_sq_norms, module, torch.randn(3, 4, 5, dtype=torch.float64), reference_sq_norms)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    ("num_groups", "input_shape"),
    # (3, 4) with 4 groups is left out: GroupNorm rejects groups holding a single value.
    [(1, (3, 4)), (2, (3, 4)), (1, (3, 4, 5)), (2, (3, 4, 5)), (4, (3, 4, 5)), (1, (3, 4, 3, 2)),
     (2, (3, 4, 3, 2)), (4, (3, 4, 3, 2))],
)
def test_group_norm(num_groups: int, input_shape: tuple[int, ...], bias: bool, reference_sq_norms) -> None:
    module = _non_trivial_affine(nn.GroupNorm(num_groups, 4, eps=1e-3).double())
    module.bias.requires_grad_(bias)
    _check(group_norm_sq_norms, module, torch.randn(input_shape, dtype=torch.float64), reference_sq_norms)


@pytest.mark.parametrize("eps", [None, 1e-2])
@pytest.mark.parametrize(("normalized_shape", "input_shape"), [(6, (4, 3, 6)), ((2, 3), (4, 2, 3))])
def test_rms_norm(
    normalized_shape, input_shape: tuple[int, ...], eps: float | None, reference_sq_norms
) -> None:
    module = _non_trivial_affine(nn.RMSNorm(normalized_shape, eps=eps).double())
    _check(rms_norm_sq_norms, module, torch.randn(input_shape, dtype=torch.float64), reference_sq_norms)


def test_unbatched_layer_norm_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="batch"):
        layer_norm_sq_norms(nn.LayerNorm((3, 4)), torch.randn(3, 4), torch.randn(3, 4))


INSTANCE_NORMS = {1: (nn.InstanceNorm1d, (3, 4, 5)), 2: (nn.InstanceNorm2d, (3, 4, 3, 2)),
                  3: (nn.InstanceNorm3d, (3, 4, 2, 3, 2))}


@pytest.mark.parametrize("dims", [1, 2, 3])
@pytest.mark.parametrize("mode", ["training", "eval with running statistics"])
def test_instance_norm(dims: int, mode: str, reference_sq_norms) -> None:
    """Each example's own statistics in training (nnU-Net's layers); its running ones in eval where tracked."""
    layer, shape = INSTANCE_NORMS[dims]
    tracked = mode != "training"
    module = _non_trivial_affine(layer(4, affine=True, eps=1e-3, track_running_stats=tracked).double())
    if tracked:
        module.running_mean.normal_()
        module.running_var.uniform_(0.5, 2.0)
        module.eval()
    _check(instance_norm_sq_norms, module, torch.randn(shape, dtype=torch.float64), reference_sq_norms)


def test_instance_norm_tracking_statistics_leaves_them_to_the_forward() -> None:
    """In training with running statistics, the forward updates them once; the norms read them not at all."""
    module = _non_trivial_affine(nn.InstanceNorm2d(4, affine=True, track_running_stats=True))
    x = torch.randn(3, 4, 3, 2)
    out = module(x)
    before = module.running_mean.clone(), module.running_var.clone()
    instance_norm_sq_norms(module, x, torch.randn_like(out))
    assert torch.equal(module.running_mean, before[0]) and torch.equal(module.running_var, before[1])


BATCH_NORMS = {1: (nn.BatchNorm1d, (3, 4)), 11: (nn.BatchNorm1d, (3, 4, 5)), 2: (nn.BatchNorm2d, (3, 4, 3, 2)),
               3: (nn.BatchNorm3d, (3, 4, 2, 3, 2))}


def _frozen_batch_norm(kind: int) -> tuple[nn.Module, tuple[int, ...]]:
    layer, shape = BATCH_NORMS[kind]
    module = _non_trivial_affine(layer(4, eps=1e-3).double()).eval()
    module.running_mean.normal_()
    module.running_var.uniform_(0.5, 2.0)
    return module, shape


@pytest.mark.parametrize("kind", sorted(BATCH_NORMS))
@pytest.mark.parametrize("frozen_weight", [False, True])
def test_batch_norm_in_eval_mode(kind: int, frozen_weight: bool, reference_sq_norms) -> None:
    """Frozen statistics (fine-tuning): each example's affine gradient is its own, against torch.func."""
    module, shape = _frozen_batch_norm(kind)
    module.weight.requires_grad_(not frozen_weight)
    _check(batch_norm_sq_norms, module, torch.randn(shape, dtype=torch.float64), reference_sq_norms)


def test_batch_norm_summed_grads_are_autograds() -> None:
    module, shape = _frozen_batch_norm(2)
    x = torch.randn(shape, dtype=torch.float64)
    weights = torch.randn_like(module(x))
    (module(x) * weights).sum().backward()
    got = batch_norm_summed_grads(module, x, weights)
    torch.testing.assert_close(got["weight"], module.weight.grad)
    torch.testing.assert_close(got["bias"], module.bias.grad)
