"""Rough per-example costs of the per-example norms and of a subset's summed gradient, per layer type.

With ``max_examples = k`` below the batch size ``b``, a pass computes the norms of ``k`` examples plus their summed
gradient (so that ``|G|²`` keeps the pairs with the unmeasured examples, :mod:`gns_callback.accumulation`), and
reads every measured parameter's gradient once more. Measuring every example costs ``b`` norms and nothing else,
and is the more precise of the two. The tracker measures a subset only when this model says it is cheaper:
never for plain ``Linear`` layers, whose norms are ``|a_i|²·|δ_i|²`` (``K + L`` multiply-adds), rarely where the
norms of a layer with many positions are sketched (:mod:`.sketch`: ``T·k·(K+L)`` against the summed gradient's
``T·K·L``), and for models whose norms cost about what their gradient does (exact norms of convolutions and
sequences, memory-bound normalisation layers) when ``k`` is well below ``b/2``.

Costs are multiply-adds per example; they only have to rank the two choices. On an accelerator a subset also
costs its extra kernels (slicing, the summed gradient, one more read of each gradient): each launch takes the
host about as long as the device takes for :data:`~.launches.ACCELERATOR_LAUNCH_COST` multiply-adds, and small
models wait for the host (benchmarks/RESULTS.md, "GPU: overhead of the callback": measuring every example of the
CNN cost less than a subset on an H100). Measuring fewer examples launches no fewer kernels.
"""

from __future__ import annotations

import math
from typing import Callable

from torch import Tensor, nn

from .conv import ConvNd
from .launches import launch_cost_per_example
from .linear import sequence_norm_cost
from .transposed_linear import TransposedLinear

#: ``(norm cost, summed-gradient cost)`` of one example, from the module, its input and output, and the batch size.
CostFunction = Callable[[nn.Module, Tensor, Tensor, int], tuple[float, float]]


def sequence_costs(positions: float, in_features: float, out_features: float,
                   launch_share: float = 0.0) -> tuple[float, float]:
    """``Σ_t a_tᵀ δ_t`` per example: the norm by the method the norms themselves pick (Gram form, materialising or
    sketch: :func:`~gns_callback.per_example.linear.sequence_norm_cost`, with ``launch_share`` a kernel launch's
    cost per example); the summed gradient ``T·K·L``."""
    if positions <= 1:
        return in_features + out_features, in_features * out_features
    norm = sequence_norm_cost(positions, in_features, out_features, launch_share)
    return norm, positions * in_features * out_features


def linear_costs(module: nn.Linear, inp: Tensor, output: Tensor, batch: int) -> tuple[float, float]:
    positions = 1.0 if inp.dim() == 2 else inp.numel() / (batch * module.in_features)
    return sequence_costs(positions, module.in_features, module.out_features,
                          launch_cost_per_example(inp.device, batch))


def transposed_linear_costs(module: nn.Module, inp: Tensor, output: Tensor, batch: int) -> tuple[float, float]:
    """As :func:`linear_costs` for ``transformers``' ``Conv1D`` (:mod:`.transposed_linear`): ``nx`` in, ``nf`` out."""
    positions = 1.0 if inp.dim() == 2 else inp.numel() / (batch * module.nx)
    return sequence_costs(positions, module.nx, module.nf, launch_cost_per_example(inp.device, batch))


def conv_costs(module: ConvNd, inp: Tensor, output: Tensor, batch: int) -> tuple[float, float]:
    positions = output.numel() / (batch * module.out_channels)
    per_output = module.in_channels // module.groups * math.prod(module.kernel_size)  # not .weight: maybe computed
    norm, summed = sequence_costs(positions, per_output, module.out_channels // module.groups,
                                  launch_cost_per_example(inp.device, batch * module.groups))
    return module.groups * norm, module.groups * summed


def conv_transpose_costs(module: nn.Module, inp: Tensor, output: Tensor, batch: int) -> tuple[float, float]:
    """As :func:`conv_costs` for the convolution whose input gradient a transposed convolution is
    (:mod:`.conv_transpose`): over its input positions, ``out/groups·kernel`` in and ``in/groups`` out."""
    positions = inp.numel() / (batch * module.in_channels)
    per_input = module.out_channels // module.groups * math.prod(module.kernel_size)  # not .weight: maybe computed
    norm, summed = sequence_costs(positions, per_input, module.in_channels // module.groups,
                                  launch_cost_per_example(inp.device, batch * module.groups))
    return module.groups * norm, module.groups * summed


#: Multiply-adds that one output element of an embedding or normalisation layer's per-example norm costs: those
#: norms are a few memory-bound passes over the output, not matrix products (one CPU thread: the CNN's three
#: GroupNorm layers' norms took 6.0 ms for 3.4 million output elements in ``benchmarks/overhead.py --profile``, a
#: matrix product 1.7 ms for 134 million multiply-adds in ``benchmarks/sketch_layers.py``; about 140, rounded down).
ELEMENTWISE_COST = 100.0


def elementwise_costs(module: nn.Module, inp: Tensor, output: Tensor, batch: int) -> tuple[float, float]:
    """Embedding and normalisation layers: a few passes over the example's output, each element at
    :data:`ELEMENTWISE_COST`, for the norm and for the summed gradient alike."""
    per_example = ELEMENTWISE_COST * output.numel() / batch
    return per_example, per_example


#: Extra kernels a subset adds per layer: slicing its examples, their summed gradient, and per parameter the
#: unmeasured examples' block (a subtraction and a dot product).
SUBSET_LAUNCHES_PER_LAYER = 4

#: Keyed by :func:`~.transposed_linear.layer_kind`, as the tracker's tables.
COSTS: dict[type, CostFunction] = {
    nn.Linear: linear_costs,
    TransposedLinear: transposed_linear_costs,
    nn.Conv1d: conv_costs,
    nn.Conv2d: conv_costs,
    nn.Conv3d: conv_costs,
    nn.ConvTranspose1d: conv_transpose_costs,
    nn.ConvTranspose2d: conv_transpose_costs,
    nn.ConvTranspose3d: conv_transpose_costs,
    nn.Embedding: elementwise_costs,
    nn.LayerNorm: elementwise_costs,
    nn.GroupNorm: elementwise_costs,
    nn.InstanceNorm1d: elementwise_costs,
    nn.InstanceNorm2d: elementwise_costs,
    nn.InstanceNorm3d: elementwise_costs,
    nn.BatchNorm1d: elementwise_costs,
    nn.BatchNorm2d: elementwise_costs,
    nn.BatchNorm3d: elementwise_costs,
    nn.PReLU: elementwise_costs,
    nn.RMSNorm: elementwise_costs,
}


def subset_is_cheaper(costs: list[tuple[float, float, int]], batch: int, measured: int,
                      launch_cost: float = 0.0) -> bool:
    """Whether ``measured`` examples' norms plus their summed gradient, plus one more read of every measured
    parameter's gradient (``costs``: per layer ``(norm, summed, parameter count)``), plus the subset's extra
    kernel launches at ``launch_cost`` multiply-adds each (0 on the CPU, :data:`~.launches.ACCELERATOR_LAUNCH_COST`
    on an accelerator), cost less than the norms of all ``batch`` examples."""
    every = batch * sum(norm for norm, _, _ in costs)
    launches = launch_cost * SUBSET_LAUNCHES_PER_LAYER
    subset = sum(measured * (norm + summed) + 2 * params + launches for norm, summed, params in costs)
    return subset < every
