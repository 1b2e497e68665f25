"""What one kernel launch costs, in the multiply-adds the device could have done meanwhile.

On the CPU an operation's cost is its arithmetic. On an accelerator the host launches each kernel, and a small
model's step waits for the host (benchmarks/RESULTS.md, "GPU: overhead of the callback"), so a method with more
kernels can be the slower one though it does less arithmetic.
"""

from __future__ import annotations

import torch

__all__ = ["ACCELERATOR_LAUNCH_COST", "launch_cost", "launch_cost_per_example"]

#: Multiply-adds a device does in the time one kernel launch costs the host (≈ 5 µs × 2·10¹³ MAC/s), rounded.
#: An understatement on an H200, where each extra operation of a sketch cost the host about 40 µs
#: (``benchmarks/gpu_conv_paths.py``).
ACCELERATOR_LAUNCH_COST = 1e8


def launch_cost(device: torch.device) -> float:
    """:data:`ACCELERATOR_LAUNCH_COST` on an accelerator, 0 on the CPU (whose kernels run on the calling thread)."""
    return 0.0 if device.type == "cpu" else ACCELERATOR_LAUNCH_COST


def launch_cost_per_example(device: torch.device, examples: int) -> float:
    """A launch's cost per example of a call over ``examples`` rows (examples × groups for a grouped layer)."""
    return launch_cost(device) / max(examples, 1)

