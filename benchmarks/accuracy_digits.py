"""Accuracy: the callback's B_simple against the exact value, on scikit-learn's digits, at fixed parameters.

For each model (MLP, CNN with GroupNorm, token model with Embedding + LayerNorm) and method, train with
SGD(lr=0) on batches drawn with replacement and compare both estimates at the callback's defaults, the run average
and the recent one (``LocalLinearRatio``), with the brute-force value over all 1797 examples. With ``--seeds N``
each case runs N batch streams: mean |relative error| and how often each interval holds the exact value.

    python benchmarks/accuracy_digits.py [--seeds 3] [--out benchmarks/RESULTS.md]
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


def run(seeds: int = 1) -> list[dict]:
    data = load_digits()
    pixels = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    inputs = {"pixels": pixels, "tokens": (pixels * 16).round().long()}
    rows = []
    for name, kind, method, accumulate, batch, steps in CASES:
        x = inputs[kind]
        exact = exact_b_simple(FACTORIES[name](), F.cross_entropy, x, y)[0]
        for seed in range(seeds):
            cb, _, _ = fit_with_gns(FACTORIES[name](), x, y, accumulate=accumulate, batch_size=batch, steps=steps,
                                    seed=seed, callback=GradientNoiseScaleCallback(method=method, verbose=False))
            row = dict(model=name, method=method, batch=f"{batch}×{accumulate}", steps=steps, exact=exact, seed=seed)
            for key, est in (("run", cb.run_estimate), ("recent", cb.estimate)):
                row[key] = dict(estimate=est.b_simple, low=est.ci_low, high=est.ci_high,
                                covered=est.ci_low <= exact <= est.ci_high)
            rows.append(row)
    return rows


def _cell(r: dict) -> str:
    return f"{r['estimate']:.1f} | {r['low']:.1f} – {r['high']:.1f} | {'yes' if r['covered'] else 'NO'}"


def summary_lines(rows: list[dict]) -> list[str]:
    """Per case, over seeds: mean |estimate/exact − 1| and the share of intervals holding the exact value."""
    lines = ["", "Over every seed: mean |relative error| and how often the 95% interval holds the exact value.", "",
             "| model | method | seeds | run average: mean abs rel err | run average: coverage | "
             "recent: mean abs rel err | recent: coverage |", "|---|---|---|---|---|---|---|"]
    cases = dict.fromkeys((r["model"], r["method"]) for r in rows)
    for model, method in cases:
        mine = [r for r in rows if (r["model"], r["method"]) == (model, method)]
        cells = []
        for key in ("run", "recent"):
            errors = [abs(r[key]["estimate"] / r["exact"] - 1.0) for r in mine]
            cells += [f"{sum(errors) / len(errors):.3f}", f"{sum(r[key]['covered'] for r in mine)}/{len(mine)}"]
        lines.append(f"| {model} | {method} | {len(mine)} | " + " | ".join(cells) + " |")
    return lines


def to_markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}. Parameters fixed (SGD lr=0), batches i.i.d. with "
        "replacement, callback defaults; run average (every step weighted equally) and recent estimate "
        "(`LocalLinearRatio`, ema_decay 0.99), each with its 95% interval; exact = brute force over all 1797 "
        "per-example gradients (`gns_callback.exact`). Seed 0:",
        "",
        "| model | method | micro-batch × accumulate | steps | exact B_simple | run average | 95% CI | exact in CI | "
        "recent | 95% CI | exact in CI |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["seed"] == 0:
            lines.append(f"| {r['model']} | {r['method']} | {r['batch']} | {r['steps']} | {r['exact']:.1f} | "
                         f"{_cell(r['run'])} | {_cell(r['recent'])} |")
    if any(r["seed"] > 0 for r in rows):
        lines += summary_lines(rows)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1, help="batch streams per case (summary table from 2)")
    parser.add_argument("--out", default=None, help="write the table into this RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    command = "python benchmarks/accuracy_digits.py" + (f" --seeds {args.seeds}" if args.seeds != 1 else "")
    table = to_markdown(run(args.seeds), command + (f" --out {args.out}" if args.out else ""))
    print(table)
    if args.out:
        replace_section(args.out, "## Accuracy against the exact value (digits)", table)


if __name__ == "__main__":
    main()
