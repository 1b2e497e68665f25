"""The cost model that decides between measuring every example and a subset with its summed gradient."""

from __future__ import annotations

import torch
from torch import nn

from gns_callback.per_example.launches import ACCELERATOR_LAUNCH_COST
from gns_callback.per_example.cost import conv_costs, linear_costs, sequence_costs, subset_is_cheaper
from gns_callback.per_example.linear import sequence_norm_method
from gns_callback.per_example.sketch import sketch_cost


def test_plain_linear_norms_are_cheaper_than_any_subset_gradient() -> None:
    layer = nn.Linear(784, 512)
    costs = [(*linear_costs(layer, torch.zeros(128, 784), torch.zeros(128, 512), 128), 784 * 512 + 512)]
    assert costs[0][:2] == (784 + 512, 784 * 512)
    assert not subset_is_cheaper(costs, batch=128, measured=16)


def test_a_narrow_convolution_with_many_positions_prefers_a_small_subset() -> None:
    """8 → 16 channels: the norms are materialised, as costly per example as the summed gradient."""
    layer = nn.Conv2d(8, 16, 3, padding=1)
    out = torch.zeros(64, 16, 32, 32)
    norm, summed = conv_costs(layer, torch.zeros(64, 8, 32, 32), out, 64)
    assert summed == 1024 * 8 * 9 * 16
    assert sequence_norm_method(1024, 8 * 9, 16) == "materialise"
    costs = [(norm, summed, layer.weight.numel())]
    assert subset_is_cheaper(costs, batch=64, measured=16)
    assert not subset_is_cheaper(costs, batch=64, measured=40)  # k > b/2: the summed gradient outweighs


def test_a_wide_convolution_is_sketched_and_measures_every_example() -> None:
    """64 → 64 channels over 32×32 positions: the sketch costs a seventh of the summed gradient: every example."""
    layer = nn.Conv2d(64, 64, 3, padding=1)
    norm, summed = conv_costs(layer, torch.zeros(64, 64, 32, 32), torch.zeros(64, 64, 32, 32), 64)
    assert norm == sketch_cost(1024, 64 * 9, 64) < summed / 6
    assert not subset_is_cheaper([(norm, summed, layer.weight.numel())], batch=64, measured=16)


def test_sequence_norms_cost_what_the_method_picked_costs() -> None:
    gram = 8**2 * (16 + 16 + 1)
    assert sequence_costs(8, 16, 16) == (gram, 8 * 16 * 16)
    assert sequence_costs(64, 16, 32) == (65 * 16 * 32, 64 * 16 * 32)
    assert sequence_costs(64, 128, 512) == (sketch_cost(64, 128, 512), 64 * 128 * 512)
    assert sequence_costs(1, 10, 20) == (30, 200)


def test_on_an_accelerator_a_subset_pays_for_its_launches() -> None:
    """A narrow convolution (batch 64, 16×16): a subset is cheaper in arithmetic, but on a GPU its extra kernels
    cost more host time than the arithmetic it saves; a large layer still prefers the subset."""
    small = nn.Conv2d(8, 16, 3, padding=1)
    costs = [(*conv_costs(small, torch.zeros(64, 8, 16, 16), torch.zeros(64, 16, 16, 16), 64), small.weight.numel())]
    assert subset_is_cheaper(costs, batch=64, measured=16)
    assert not subset_is_cheaper(costs, batch=64, measured=16, launch_cost=ACCELERATOR_LAUNCH_COST)
    large = nn.Conv2d(16, 16, 3, padding=1)
    out = torch.zeros(256, 16, 224, 224, device="meta")  # shapes only
    costs = [(*conv_costs(large, out, out, 256), large.weight.numel())]
    assert subset_is_cheaper(costs, batch=256, measured=16, launch_cost=ACCELERATOR_LAUNCH_COST)
