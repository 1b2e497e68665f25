#!/usr/bin/env python
"""Interval calibration of bare parameters read at matrix products and through slices: the framework-free meter in a
plain loop at fixed parameters (``benchmarks/model_scan.py``'s hand-written attention, minGPT-style model and
hand-written layer), ``N`` data orders × 150 steps of 32 digits drawn with replacement, against the exact B_simple.

    python benchmarks/bare_parameter_calibration.py [N=40]
"""
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.model_scan import (HandWrittenAttention, HandWrittenLayer, MinGptStyle,  # noqa: E402
                                   digits_and_tokens)
from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402


def calibrate(make, inputs: torch.Tensor, labels: torch.Tensor, orders: int) -> str:
    """Exact value, coverage, intervals holding it, and the run averages' ratio to it over ``orders`` streams."""
    torch.manual_seed(0)
    model = make()
    exact = exact_b_simple(model, F.cross_entropy, inputs, labels)[0]
    holds, ratios, coverage = 0, [], 0.0
    for seed in range(orders):
        draws = torch.Generator().manual_seed(1000 + seed)
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(150):
                index = torch.randint(0, len(inputs), (32,), generator=draws)
                model.zero_grad()
                F.cross_entropy(model(inputs[index]), labels[index]).backward()
                meter.step()
            run, coverage = meter.run_estimate, meter.coverage["fraction"]
        holds += run.ci_low <= exact <= run.ci_high
        ratios.append(run.b_simple / exact)
    ratio = torch.tensor(ratios)
    return (f"{exact:.2f} | {coverage:.0%} | {holds} of {orders} | {ratio.median():.3f} | {ratio.mean():.3f} ± "
            f"{ratio.std() / orders**0.5:.3f} |")


def main() -> None:
    orders = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    pixels, tokens, labels = digits_and_tokens()
    print("| model | exact B_simple | coverage | intervals holding it | run average / exact: median | mean ± s.e. |\n"
          "|---|---|---|---|---|---|")
    for name, make, inputs in [("hand-written attention", HandWrittenAttention, pixels),
                               ("minGPT-style (sliced table)", MinGptStyle, tokens),
                               ("hand-written layer, nn.Linear head", HandWrittenLayer, pixels)]:
        print(f"| {name} | {calibrate(make, inputs, labels, orders)}", flush=True)


if __name__ == "__main__":
    main()
