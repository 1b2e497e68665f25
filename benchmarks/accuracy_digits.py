"""Accuracy: the callback's B_simple against the exact value, on scikit-learn's digits, at fixed parameters.

For each model (MLP, CNN with GroupNorm, token model with Embedding + LayerNorm) and method, train with
SGD(lr=0) on batches drawn with replacement and compare with the brute-force value over all 1797 examples.

    python benchmarks/accuracy_digits.py [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from sklearn.datasets import load_digits  # noqa: E402

from gns_callback import GradientNoiseScaleCallback  # noqa: E402
from gns_callback.exact import exact_b_simple  # noqa: E402
from tests.helpers import fit_with_gns, mlp, small_cnn, token_model  # noqa: E402

from benchmarks.results import replace_section  # noqa: E402

CASES = [  # model, data kind, method, accumulate, micro-batch, steps
    ("MLP 64-32-10", "pixels", "per_example", 1, 32, 300),
    ("MLP 64-32-10", "pixels", "micro_batch", 4, 8, 300),
    ("CNN + GroupNorm", "pixels", "per_example", 1, 32, 300),
    ("CNN + GroupNorm", "pixels", "micro_batch", 4, 8, 300),
    ("Embedding + LayerNorm tokens", "tokens", "per_example", 1, 64, 300),
    ("Embedding + LayerNorm tokens", "tokens", "micro_batch", 4, 16, 300),
]
FACTORIES = {"MLP 64-32-10": mlp, "CNN + GroupNorm": small_cnn, "Embedding + LayerNorm tokens": token_model}


def run() -> list[dict]:
    data = load_digits()
    pixels = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    inputs = {"pixels": pixels, "tokens": (pixels * 16).round().long()}
    rows = []
    for name, kind, method, accumulate, batch, steps in CASES:
        x = inputs[kind]
        exact = exact_b_simple(FACTORIES[name](), F.cross_entropy, x, y)[0]
        cb, _, _ = fit_with_gns(FACTORIES[name](), x, y, accumulate=accumulate, batch_size=batch, steps=steps, seed=0,
                                callback=GradientNoiseScaleCallback(method=method, verbose=False))
        est = cb.run_estimate
        rows.append(dict(model=name, method=method, batch=f"{batch}×{accumulate}", steps=steps, exact=exact,
                         estimate=est.b_simple, low=est.ci_low, high=est.ci_high,
                         covered=est.ci_low <= exact <= est.ci_high))
    return rows


def to_markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}. Parameters fixed (SGD lr=0), batches i.i.d. with "
        "replacement, run-average estimate with its 95% Fieller interval; exact = brute force over all 1797 "
        "per-example gradients (`gns_callback.exact`).",
        "",
        "| model | method | micro-batch × accumulate | steps | exact B_simple | estimate | 95% CI | exact in CI |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['method']} | {r['batch']} | {r['steps']} | {r['exact']:.1f} | {r['estimate']:.1f} | "
            f"{r['low']:.1f} – {r['high']:.1f} | {'yes' if r['covered'] else 'NO'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the table into this RESULTS.md")
    args = parser.parse_args()
    table = to_markdown(run(), "python benchmarks/accuracy_digits.py" + (f" --out {args.out}" if args.out else ""))
    print(table)
    if args.out:
        replace_section(args.out, "## Accuracy against the exact value (digits)", table)


if __name__ == "__main__":
    main()
