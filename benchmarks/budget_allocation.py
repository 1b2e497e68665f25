#!/usr/bin/env python
"""Where a per-example budget buys the most accuracy: fewer steps, fewer examples, or |G_B|² at every step?

    python benchmarks/budget_allocation.py [--streams 40] [--steps 400] [--batch 32] [--out benchmarks/RESULTS.md]

Issue 14 asks, where per-example norms of every example at every step cost too much, to spend the example budget
where it reduces the error most. Every step gives two numbers: the big batch's ``|G_B|²`` (one read of ``.grad``,
cheap) and the mean squared norm ``m`` of its examples' gradients (the per-example hooks, the expensive part). The
unbiased step estimates (McCandlish et al. 2018, appendix A) are ``tr Σ = B·(m − |G_B|²)/(B − 1)`` and
``|G|² = |G_B|² − tr Σ/B``; the run average is ``Σ tr Σ / Σ |G|²``.

For each model (issue 14's three frozen cases of ``benchmarks/accuracy_peers.py`` and the digits token model of the
tests, whose gradient spreads over many more directions) the exact per-example gradient of every example is
computed once (``gns_callback.exact``); each stream draws its batches i.i.d. with replacement and forms, from those
rows, what the meter would read. Rows:

- **every example, every step**: the meter at ``per_example_max_examples=None`` (the full budget);
- **1 step in n**: every example of one step in ``n`` (``measure_every_n_steps=n``), ``1/n`` of the budget;
- **|G_B|² every step, examples 1 step in n**: ``tr Σ`` from the measured steps, ``|G|² = mean |G_B|² − tr Σ/B``
  over every step; the same ``1/n`` of the budget;
- **B/n examples every step**: ``m`` from ``B/n`` examples, ``|G|²`` blended from the pair and two-batch-size
  estimates (:class:`gns_callback.blend.PairBlend`, what the meter does with a subset); ``1/n`` of the norms;
- **|G_B|² noise alone** / **small-batch noise alone**: every step, with the other number replaced by its exact
  expectation: which of the two carries the error;
- AdaptDL's step differencing on the same streams (``benchmarks/peers_gns.py``), the best peer of issue 14.

Reported: mean |run-average ratio / exact − 1| ± its standard error over streams, and pooled over the cases.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.accuracy_peers import CASES, PEERS, _digits, frozen_model, run_peers  # noqa: E402
from benchmarks.results import replace_section  # noqa: E402
from benchmarks.subset_estimators import pair_grad_sq  # noqa: E402
from gns_callback.blend import PairBlend  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from tests.helpers import token_model  # noqa: E402

HEADING = "## Spending a per-example budget: steps, examples or |G_B|² (issue 14 item 1)"
ADAPTDL = PEERS[2]
CHUNK = 50  # steps gathered at once (steps × B × parameters floats)
STREAM_SEED = 20_000


def cases() -> list[tuple[str, str, torch.Tensor]]:
    """(key, name, exact per-example gradient rows) per model."""
    out = []
    for case in CASES[:3]:
        x, y = case.data()
        out.append((case.key, case.name, per_example_gradients(frozen_model(case, x, y), F.cross_entropy, x, y)))
    pixels, labels = _digits()
    tokens = (pixels * 16).round().long()
    out.append(("tokens", "digits as 64 pixel tokens, Embedding + LayerNorm (tests.helpers.token_model)",
                per_example_gradients(token_model(), F.cross_entropy, tokens, labels)))
    return out


def step_values(rows: torch.Tensor, batches: torch.Tensor, subsets: Sequence[int]) -> dict[str, Any]:
    """Per step, from one gathering of the batches' rows: ``big`` = |G_B|², ``every`` = mean squared norm of all B
    examples, and for each ``k`` in ``subsets``: ``subset[k]`` = that of the first ``k``, ``unmeasured[k]`` =
    |Σ of the others' gradients|² (for the pair estimate)."""
    big, every = [], []
    subset: dict[int, list[torch.Tensor]] = {k: [] for k in subsets}
    unmeasured: dict[int, list[torch.Tensor]] = {k: [] for k in subsets}
    for chunk in batches.split(CHUNK):
        g = rows[chunk]  # (steps, B, P)
        sq = g.square().sum(-1)
        big.append(g.mean(1).square().sum(-1))
        every.append(sq.mean(1))
        for k in subsets:
            subset[k].append(sq[:, :k].mean(1))
            unmeasured[k].append(g[:, k:].sum(1).square().sum(-1))
    return {"big": torch.cat(big), "every": torch.cat(every),
            "subset": {k: torch.cat(v) for k, v in subset.items()},
            "unmeasured": {k: torch.cat(v) for k, v in unmeasured.items()}}


def ratio(trace: torch.Tensor, grad_sq: torch.Tensor) -> float:
    """The run average ``Σ tr Σ / Σ |G|²`` (means, so that the two may come from different steps)."""
    return float(trace.mean() / grad_sq.mean())


def full(big: torch.Tensor, mean_sq: torch.Tensor, batch: int) -> float:
    trace = batch * (mean_sq - big) / (batch - 1)
    return ratio(trace, big - trace / batch)


def mixed(big: torch.Tensor, mean_sq: torch.Tensor, batch: int, every: int) -> float:
    """tr Σ from the steps whose examples were measured, |G|² from |G_B|² of every step."""
    pick = slice(None, None, every)
    trace = batch * (mean_sq[pick] - big[pick]) / (batch - 1)
    return float(trace.mean() / (big.mean() - trace.mean() / batch))


def subset_blend(v: dict[str, Any], batch: int, measured: int) -> float:
    """``measured`` examples per step: |G|² blended from the pair and two-batch-size estimates, as the meter does."""
    m, big = v["subset"][measured], v["big"]
    two_batch = (batch * big - m) / (batch - 1)
    pairs = pair_grad_sq(big, m * measured, v["unmeasured"][measured], batch, measured)
    blend = PairBlend()
    valid = torch.tensor(True)
    grad_sq = torch.stack([torch.as_tensor(blend.blend(m[t], pairs[t], two_batch[t], valid))
                           for t in range(m.shape[0])]).to(m.dtype)
    return ratio(m - grad_sq, grad_sq)


def stream_readings(rows: torch.Tensor, batches: torch.Tensor, exact_sq: float, exact_trace: float,
                    fractions: list[int]) -> dict[str, float]:
    batch = batches.shape[1]
    out: dict[str, float] = {}
    subsets = {n: max(2, round(batch / n)) for n in fractions}
    values = step_values(rows, batches, sorted(set(subsets.values())))
    big, every = values["big"], values["every"]
    out["every example, every step"] = full(big, every, batch)
    mean_sq, mean_big = exact_sq + exact_trace, exact_sq + exact_trace / batch  # E m, E |G_B|²
    out["|G_B|² noise alone"] = full(big, torch.full_like(every, mean_sq), batch)
    out["small-batch noise alone"] = full(torch.full_like(big, mean_big), every, batch)
    for n in fractions:
        pick = slice(None, None, n)
        out[f"1/{n}: every example, 1 step in {n}"] = full(big[pick], every[pick], batch)
        out[f"1/{n}: |G_B|² every step, examples 1 step in {n}"] = mixed(big, every, batch, n)
        out[f"1/{n}: {subsets[n]} of {batch} examples every step"] = subset_blend(values, batch, subsets[n])
    out[ADAPTDL] = run_peers(rows, batches)[ADAPTDL].estimate
    return out


Case = tuple[str, str, torch.Tensor]


def run(streams: int, steps: int, batch: int, fractions: list[int],
        case_list: Optional[list[Case]] = None) -> list[dict]:
    results = []
    for key, name, rows in case_list or cases():
        exact, grad_sq, trace = exact_noise_scale(rows)
        errors: dict[str, list[float]] = {}
        for s in range(streams):
            draws = torch.Generator().manual_seed(STREAM_SEED + s)
            batches = torch.randint(0, rows.shape[0], (steps, batch), generator=draws)
            for label, value in stream_readings(rows, batches, grad_sq, trace, fractions).items():
                errors.setdefault(label, []).append(abs(value / exact - 1.0))
        results.append({"key": key, "name": name, "exact": exact, "ratio": exact / batch, "errors": errors,
                        "examples": rows.shape[0], "parameters": rows.shape[1]})
        print(f"{key}: done", file=sys.stderr, flush=True)
    return results


def _cell(values: list[float]) -> str:
    se = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"{statistics.fmean(values):.3f} ± {se:.3f}"


def to_markdown(results: list[dict], command: str, streams: int, steps: int, batch: int, seconds: float) -> str:
    labels = list(results[0]["errors"])
    keys = [r["key"] for r in results]
    lines = [f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, x86_64, 2 cores, torch {torch.__version__}, "
             f"{seconds / 60:.1f} min. {streams} streams × {steps} steps at batch {batch}, drawn i.i.d. with "
             "replacement, the same streams for every row; formulas on the exact per-example gradients "
             "(`benchmarks/budget_allocation.py`'s docstring says what each row measures).", "",
             "| case | examples | parameters | exact B_simple | B_simple/B |", "|---|---|---|---|---|"]
    lines += [f"| {r['key']}: {r['name']} | {r['examples']} | {r['parameters']} | {r['exact']:.1f} | "
              f"{r['ratio']:.2f} |" for r in results]
    lines += ["", "Mean |relative error| of the run average ± its standard error over streams:", "",
              "| estimator | " + " | ".join(keys) + " | pooled |", "|---|" + "---|" * (len(keys) + 1)]
    for label in labels:
        pooled = [e for r in results for e in r["errors"][label]]
        lines.append(f"| {label} | " + " | ".join(_cell(r["errors"][label]) for r in results)
                     + f" | {_cell(pooled)} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fractions", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--out", type=Path, default=None, help="write/replace this section of a markdown file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = run(args.streams, args.steps, args.batch, args.fractions)
    command = " ".join(["python benchmarks/budget_allocation.py", *(sys.argv[1:] if argv is None else argv)])
    text = to_markdown(results, command, args.streams, args.steps, args.batch, time.perf_counter() - start)
    if args.out is not None:
        replace_section(args.out, HEADING, text)
    print(HEADING + "\n\n" + text)
    return text


if __name__ == "__main__":
    main()
