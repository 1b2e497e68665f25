"""A loop of one's own that changes the gradients before ``meter.step()``, against the exact ``B_simple``
(``tests/trust/test_loop_changes_gradients.py``'s setup: the digits MLP at fixed parameters, batch 32, 300 steps).
RESULTS.md, "Gradients changed in a loop of one's own".

    python benchmarks/loop_gradient_changes.py --seeds 5

Each change: none, ``clip_grad_norm_`` that never clips, at the median and the 10th percentile of the batch-gradient
norm, ``clip_grad_value_``, and zeroing half of the first layer's weight gradient. ``--mark-off`` takes the meter's
own mark of the end of backward away (as before 2026-11-29: the check ran only where the loop called
``meter.backward_done()``).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402
from tests.helpers import mlp  # noqa: E402
from tests.trust.test_loop_changes_gradients import (clip_norm, clip_value, measure,  # noqa: E402
                                                     zero_half_of_the_first_layer)


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)


def batch_norm_quantiles(x: torch.Tensor, y: torch.Tensor, draws: int = 200) -> tuple[float, float]:
    """The median and 10th percentile of the batch-gradient norm at batch 32."""
    net, g, norms = mlp(), torch.Generator().manual_seed(123), []
    for _ in range(draws):
        rows = torch.randint(0, len(x), (32,), generator=g)
        net.zero_grad()
        F.cross_entropy(net(x[rows]), y[rows]).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])))
    q = torch.tensor(norms).quantile(torch.tensor([0.5, 0.1])).tolist()
    return q[0], q[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--mark-off", action="store_true")
    options = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    if options.mark_off:
        GradientNoiseScaleMeter._backward_ended = lambda self: None
    x, y = digits()
    exact = exact_b_simple(mlp(), F.cross_entropy, x, y)[0]
    median, tenth = batch_norm_quantiles(x, y)
    print(f"exact B_simple {exact:.1f}; batch-gradient norm median {median:.3f}, 10th percentile {tenth:.3f}")
    changes = {"none": lambda net: None, "clip_grad_norm_ 1e6 (never clips)": clip_norm(1e6),
               f"clip_grad_norm_ {median:.3f} (median)": clip_norm(median),
               f"clip_grad_norm_ {tenth:.3f} (10th pct)": clip_norm(tenth), "clip_grad_value_ 1e-3": clip_value(1e-3),
               "half the first layer's gradient zeroed": zero_half_of_the_first_layer}
    for name, change in changes.items():
        held, readings = 0, []
        for seed in range(options.seeds):
            est = measure(mlp(), x, y, change, seed=seed, steps=300)[0].run_estimate
            if not est.measured:
                readings.append("not measured")
                continue
            held += est.ci_low <= exact <= est.ci_high
            readings.append(f"{est.b_simple:.1f} [{est.ci_low:.1f}, {est.ci_high:.1f}]")
        print(f"{name}: held {held} of {options.seeds}; " + "; ".join(readings), flush=True)


if __name__ == "__main__":
    main()
