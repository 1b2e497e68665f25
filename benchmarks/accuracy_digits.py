"""Accuracy: the callback's B_simple against the exact value, on scikit-learn's digits, at fixed parameters.

For each model (MLP, CNN with GroupNorm, token model with Embedding + LayerNorm) and method, train with
SGD(lr=0) on batches drawn with replacement and compare both estimates at the callback's defaults, the run average
and the recent one (``LocalLinearRatio``), with the brute-force value over all 1797 examples. The recent
estimate is also read as it was before its window was chosen by the measured drift (the base-window trend fit,
``gns_callback.tracking.fallback_fit``), from the same tracker. With ``--seeds N`` each case runs N batch streams:
mean |relative error|, how often each interval holds the exact value, and the median interval width
``ci_high/ci_low``.

    python benchmarks/accuracy_digits.py [--seeds 3] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import math
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
from gns_callback.tracking import fallback_fit  # noqa: E402
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
            base = fallback_fit(cb.meter.ema.fits(cb.meter.confidence)[0])
            for key, (value, low, high) in (("run", _triple(cb.run_estimate)), ("recent", _triple(cb.estimate)),
                                            ("base", (base.ratio, base.ci_low, base.ci_high))):
                row[key] = dict(estimate=value, low=low, high=high, covered=low <= exact <= high)
            rows.append(row)
    return rows


def _triple(estimate) -> tuple[float, float, float]:
    return estimate.b_simple, estimate.ci_low, estimate.ci_high


def _cell(r: dict) -> str:
    return f"{r['estimate']:.1f} | {r['low']:.1f} – {r['high']:.1f} | {'yes' if r['covered'] else 'NO'}"


SUMMARIES = (("run", "run average"), ("recent", "recent"), ("base", "recent before the window choice"))


def summary_lines(rows: list[dict]) -> list[str]:
    """Per case, over seeds: mean |estimate/exact − 1|, the share of intervals holding the exact value, and the
    median interval width ``ci_high/ci_low``, for the run average, the recent estimate, and the recent estimate's
    base-window reading (before the window choice)."""
    head = " | ".join(f"{name}: {what}" for _, name in SUMMARIES for what in ("mean abs rel err", "coverage",
                                                                              "median width"))
    lines = ["", "Over every seed: mean |relative error|, how often the 95% interval holds the exact value, and the "
             "median interval width (ci_high/ci_low).", "", f"| model | method | seeds | {head} |",
             "|---|---|---|" + "---|" * (3 * len(SUMMARIES))]
    cases = dict.fromkeys((r["model"], r["method"]) for r in rows)
    pooled: dict[str, list] = {key: [] for key, _ in SUMMARIES}
    for model, method in cases:
        mine = [r for r in rows if (r["model"], r["method"]) == (model, method)]
        cells = []
        for key, _ in SUMMARIES:
            pooled[key] += [r[key] | {"exact": r["exact"]} for r in mine]
            cells += _summary_cells([r[key] | {"exact": r["exact"]} for r in mine])
        lines.append(f"| {model} | {method} | {len(mine)} | " + " | ".join(cells) + " |")
    cells = [cell for key, _ in SUMMARIES for cell in _summary_cells(pooled[key])]
    lines.append(f"| all | | {len(rows)} | " + " | ".join(cells) + " |")
    return lines


def _summary_cells(readings: list[dict]) -> list[str]:
    errors = [abs(r["estimate"] / r["exact"] - 1.0) for r in readings]
    widths = sorted(r["high"] / r["low"] if r["low"] > 0 else math.inf for r in readings)
    median = widths[len(widths) // 2] if len(widths) % 2 else 0.5 * (widths[len(widths) // 2 - 1]
                                                                    + widths[len(widths) // 2])
    return [f"{sum(errors) / len(errors):.3f}", f"{sum(r['covered'] for r in readings)}/{len(readings)}",
            f"{median:.2f}"]


def to_markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}. Parameters fixed (SGD lr=0), batches i.i.d. with "
        "replacement, callback defaults; run average (every step weighted equally) and recent estimate "
        "(`LocalLinearRatio`, ema_decay 0.99, window chosen by the measured drift), each with its 95% interval; "
        "recent before the window choice = the same tracker's base-window trend fit (`tracking.fallback_fit`); "
        "exact = brute force over all 1797 per-example gradients (`gns_callback.exact`). Seed 0:",
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
