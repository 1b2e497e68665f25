"""Accuracy against public peers (issue 14): ``B_simple`` at fixed parameters, this project against nanoGNS,
gpt-neox and AdaptDL, each at its defaults, against the exact brute-force value.

Cases (scikit-learn's bundled data, offline; features standardised, digits pixels /16): breast-cancer logistic
regression ``nn.Linear(30, 2)``, wine MLP 13-16-3 (tanh), digits CNN with Conv + GroupNorm
(``tests.helpers.small_cnn``), all measured at batch 32 as in issue 14; and a wider digits CNN measured at batch 64,
where the default measures a subset of the examples. Each model is trained with plain SGD (lr 0.1, batches of 32 drawn with replacement,
seed 0) for its ``train_steps`` steps, then frozen: every estimator then sees the same batches of 32 drawn i.i.d.
with replacement at these parameters, ``--steps`` steps (default 400) per stream, ``--seeds`` streams (default 20).
Exact value: ``gns_callback.exact.exact_noise_scale`` of every per-example gradient of the data set.

Where to freeze (25, 100, 100 steps) was chosen from the exact ``B_simple`` along each training run and the peers'
errors only (not this project's): partway, with ``B_simple/B`` from about 2 to 6 (the per-example cap matters more
as it grows), yet not so noisy that 400 steps at batch 32 leave every estimator tens of percent off (the logistic
regression's ``B_simple`` reaches 279 by step 100, where even a brute-force run average of every example's norm is
about 20% off).

Estimators (each reads the same batches of a stream):

* this project through its public API only, :class:`gns_callback.GradientNoiseScaleMeter` hooked on the model, one
  backward pass per step and ``meter.step()``, read after the last step: ``meter.estimate`` (recent, the headline)
  and ``meter.run_estimate`` (run average), each with its 95% interval; at its defaults (``per_example``,
  ``per_example_max_examples=16``: every example where its cost model says that is cheaper, else 16 examples plus
  their summed gradient), with ``per_example_max_examples=None``, and ``method="micro_batch"`` in backward passes of
  8 examples (each loss divided by their count, ``meter.step(micro_batch_size=8)``), and at its defaults measuring
  one step in four (``measure_every_n_steps=4``: a quarter of the steps, for about a quarter of the cost);
* nanoGNS, gpt-neox and AdaptDL as re-implemented in ``benchmarks/peers_gns.py`` (sources, commits and deviations in
  its docstring), fed each step's batch gradient and per-example squared norms, computed from the exact per-example
  gradient rows of the step's batch (parameters are fixed, so these are the gradients the peer would read).

Reported: mean |estimate/exact − 1| over streams per case and pooled over cases (± its standard error), the mean
signed relative error, and for estimators with an interval how often it holds the exact value.

    python benchmarks/accuracy_peers.py --out benchmarks/RESULTS.md   # 20 seeds × 400 steps, a few CPU-minutes
    python benchmarks/accuracy_peers.py --quick                       # 2 seeds × 60 steps (smoke test)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine  # noqa: E402

from benchmarks.peers_gns import AdaptDLGNS, GptNeoxGNS, NanoGNS  # noqa: E402
from benchmarks.results import replace_section  # noqa: E402
from gns_callback import GradientNoiseScaleMeter  # noqa: E402
from gns_callback.exact import exact_noise_scale, per_example_gradients  # noqa: E402
from tests.helpers import mlp, small_cnn  # noqa: E402

HEADING = "## Accuracy against public peers (issue 14)"
BATCH, MICRO = 32, 8
TRAIN_LR = 0.1  # "partway through training": plain SGD at this lr for each case's train_steps, then frozen
STREAM_SEED = 10_000  # stream s draws its batches from Generator().manual_seed(STREAM_SEED + s)


# ---------------------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    key: str
    name: str
    data: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    model: Callable[[], nn.Module]
    train_steps: int  # plain SGD steps before the parameters are frozen
    batch: int = BATCH  # examples per measured step


def _standardised(loader) -> tuple[torch.Tensor, torch.Tensor]:
    data = loader()
    x = torch.tensor(data.data, dtype=torch.float32)
    return (x - x.mean(0)) / (x.std(0) + 1e-8), torch.tensor(data.target)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


def _wine_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(13, 16), nn.Tanh(), nn.Linear(16, 3))


def _wide_cnn() -> nn.Module:
    """Convolutions wide enough that, at batch 64, the default measures 16 examples and their summed gradient."""
    return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(4, 32), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10))


CASES = [
    Case("bc", "breast-cancer logistic regression 30-2", lambda: _standardised(load_breast_cancer),
         lambda: nn.Linear(30, 2), 25),
    Case("wine", "wine MLP 13-16-3 (tanh)", lambda: _standardised(load_wine), _wine_mlp, 100),
    Case("cnn", "digits CNN, Conv + GroupNorm", _digits, small_cnn, 100),
    Case("cnn64", "digits CNN 16-32 channels + GroupNorm, batch 64", _digits, _wide_cnn, 100, batch=64),
]


def _deep_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))


#: ``--held-out``: cases no default was chosen on (other data, depths, activations, norms and a batch of 64).
HELD_OUT = [
    Case("iris", "iris MLP 4-16-3 (tanh)", lambda: _standardised(load_iris),
         lambda: nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)), 50),
    Case("digmlp", "digits MLP 64-32-10 (tanh)", _digits, mlp, 100),
    Case("bcmlp", "breast-cancer MLP 30-32-2 (ReLU)", lambda: _standardised(load_breast_cancer),
         lambda: nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2)), 30),
    Case("deep", "digits MLP 64-64-64-64-10, LayerNorm, GELU", _digits, _deep_mlp, 200),
    Case("wine64", "wine MLP 13-16-3 at batch 64", lambda: _standardised(load_wine), _wine_mlp, 100, batch=64),
]
HELD_OUT_HEADING = "## Accuracy against public peers: cases held out from every choice (written by the script)"


def frozen_model(case: Case, x: torch.Tensor, y: torch.Tensor, steps: Optional[int] = None) -> nn.Module:
    """``case.model()`` after ``steps`` (default ``case.train_steps``) plain SGD steps (lr ``TRAIN_LR``, batches of 32
    with replacement, seed 0)."""
    steps = case.train_steps if steps is None else steps
    torch.manual_seed(0)
    model = case.model()
    train_sgd(model, x, y, steps, TRAIN_LR)
    return model


def train_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, lr: float, seed: int = 0) -> None:
    """``steps`` plain SGD steps of cross-entropy on batches of ``BATCH`` drawn with replacement (draws seeded
    ``seed``); gradients cleared after."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    draws = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, x.shape[0], (BATCH,), generator=draws)
        optimizer.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------- estimators
@dataclass(frozen=True)
class Reading:
    estimate: float
    low: float = math.nan  # NaN: the estimator gives no interval
    high: float = math.nan


OURS = {  # row label prefix: meter arguments, micro-batch size (None: one backward pass of the whole batch)
    "this project, `per_example` at its defaults": ({}, None),
    "this project, `per_example_max_examples=None`": ({"per_example_max_examples": None}, None),
    "this project, `micro_batch`, passes of 8": ({"method": "micro_batch"}, MICRO),
    "this project, `measure_every_n_steps=4`": ({"measure_every_n_steps": 4}, None),
}
READS = (("`estimate` (recent)", 0), ("`run_estimate`", 1))
PEERS = ("nanoGNS exact per-example (every example), EMA 0.99", "gpt-neox, 5 consecutive steps, EMA 0.99",
         "AdaptDL step differencing, smoothing 0.999²")


def run_ours(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batches: torch.Tensor, meter_args: dict,
             micro: Optional[int]) -> tuple[Reading, Reading]:
    """The meter hooked on ``model`` over the stream ``batches`` (steps, B); (recent, run average) after the last step."""
    with GradientNoiseScaleMeter(model, **meter_args) as meter:
        for index in batches:
            if micro is None:
                F.cross_entropy(model(x[index]), y[index]).backward()
                meter.step()
            else:
                passes = index.split(micro)
                for part in passes:
                    (F.cross_entropy(model(x[part]), y[part]) / len(passes)).backward()
                meter.step(micro_batch_size=micro)
            model.zero_grad(set_to_none=True)
        readings = meter.read()
    return tuple(Reading(r.b_simple, r.ci_low, r.ci_high) for r in readings)


def run_peers(rows: torch.Tensor, batches: torch.Tensor) -> dict[str, Reading]:
    """The three peers over the stream, fed from the exact per-example gradient ``rows`` (N, P) of each batch."""
    nano, neox, adaptdl = NanoGNS(), GptNeoxGNS(batch_size_small=batches.shape[1]), AdaptDLGNS(batches.shape[1])
    for index in batches:
        batch_rows = rows[index]
        grad = batch_rows.mean(0)
        nano.update(grad, batch_rows.pow(2).sum(1))
        neox.update(grad)
        adaptdl.update(grad)
    return {name: Reading(peer.value) for name, peer in zip(PEERS, (nano, neox, adaptdl))}


def run_stream(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
               batches: torch.Tensor) -> dict[str, Reading]:
    """Every estimator's final reading on one stream of batches."""
    out = {}
    for label, (meter_args, micro) in OURS.items():
        readings = run_ours(model, x, y, batches, meter_args, micro)
        for read, i in READS:
            out[f"{label}: {read}"] = readings[i]
    out.update(run_peers(rows, batches))
    return out


def run_case(case: Case, seeds: int, steps: int) -> dict:
    """Exact value and every estimator's reading on each of ``seeds`` streams of ``steps`` batches."""
    x, y = case.data()
    model = frozen_model(case, x, y)
    rows = per_example_gradients(model, F.cross_entropy, x, y)
    exact, grad_sq, trace = exact_noise_scale(rows)
    streams = []
    for seed in range(seeds):
        draws = torch.Generator().manual_seed(STREAM_SEED + seed)
        batches = torch.randint(0, x.shape[0], (steps, case.batch), generator=draws)
        streams.append(run_stream(model, x, y, rows, batches))
    return {"case": case, "exact": exact, "grad_sq": grad_sq, "trace": trace, "examples": x.shape[0],
            "parameters": rows.shape[1], "streams": streams}


def run(seeds: int = 20, steps: int = 400, cases: Optional[list[Case]] = None) -> list[dict]:
    return [run_case(case, seeds, steps) for case in (cases or CASES)]


# ---------------------------------------------------------------------------------------------- scores
def relative_errors(result: dict, estimator: str) -> list[float]:
    """``estimate/exact − 1`` per stream (NaN/inf readings kept: they count as failures in the mean)."""
    return [s[estimator].estimate / result["exact"] - 1.0 for s in result["streams"]]


def coverage(result: dict, estimator: str) -> Optional[tuple[int, int]]:
    """(streams whose interval holds the exact value, streams), or None without an interval."""
    readings = [s[estimator] for s in result["streams"]]
    if all(math.isnan(r.low) for r in readings):
        return None
    return sum(r.low <= result["exact"] <= r.high for r in readings), len(readings)


def mean_and_se(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, math.nan
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def estimators(results: list[dict]) -> list[str]:
    return list(results[0]["streams"][0])


# ---------------------------------------------------------------------------------------------- markdown
def _error_cell(errors: list[float]) -> str:
    mean, se = mean_and_se([abs(e) for e in errors])
    return f"{mean:.3f} ± {se:.3f}" if math.isfinite(se) else f"{mean:.3f}"


def _table(results: list[dict], cell: Callable[[list[dict], str], str],
           extra: Optional[tuple[str, Callable[[list[dict], str], str]]] = None) -> list[str]:
    """One row per estimator: ``cell`` per case and pooled over cases (then ``extra``'s pooled column, if any)."""
    keys = [r["case"].key for r in results] + ["pooled"] + ([extra[0]] if extra else [])
    lines = ["| estimator | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for name in estimators(results):
        cells = [cell([r], name) for r in results] + [cell(results, name)] + ([extra[1](results, name)] if extra else [])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _abs_error(results: list[dict], name: str) -> str:
    return _error_cell([e for r in results for e in relative_errors(r, name)])


def _median_abs_error(results: list[dict], name: str) -> str:
    errors = sorted(abs(e) for r in results for e in relative_errors(r, name))
    middle = len(errors) // 2
    median = errors[middle] if len(errors) % 2 else (errors[middle - 1] + errors[middle]) / 2
    return f"{median:.3f}"


def _signed_error(results: list[dict], name: str) -> str:
    mean, _ = mean_and_se([e for r in results for e in relative_errors(r, name)])
    return f"{mean:+.3f}"


def _coverage(results: list[dict], name: str) -> str:
    counts = [coverage(r, name) for r in results]
    if any(c is None for c in counts):
        return "—"
    held, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    unbounded = sum(math.isinf(s[name].high) for r in results for s in r["streams"])
    return f"{held}/{total}" + (f" ({unbounded} unbounded)" if unbounded else "")


def case_lines(results: list[dict]) -> list[str]:
    lines = ["| case | examples | parameters | SGD steps before freezing | batch B | exact B_simple | B_simple/B | "
             "exact \\|G\\|² | exact tr Σ |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['case'].key}: {r['case'].name} | {r['examples']} | {r['parameters']} | "
                     f"{r['case'].train_steps} | {r['case'].batch} | "
                     f"{r['exact']:.1f} | {r['exact'] / r['case'].batch:.2f} | {r['grad_sq']:.4g} | {r['trace']:.4g} |")
    return lines


def to_markdown(results: list[dict], command: str, seeds: int, steps: int, seconds: float) -> str:
    rows_with_interval = [n for n in estimators(results) if coverage(results[0], n) is not None]
    lines = [
        f"Command: `{command}` — {time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores (one torch thread), torch {torch.__version__}, {seconds / 60:.1f} min. Each model "
        f"trained with plain SGD (lr {TRAIN_LR}, batch {BATCH} with replacement, seed 0) for the steps below, then "
        "frozen; "
        f"{seeds} streams × {steps} steps of the case's batch drawn i.i.d. with replacement, the same streams for every "
        "estimator; our default (`per_example_max_examples=16`) measures every example where its cost model finds "
        "that cheaper, else 16 examples plus their summed gradient (where the rows of the default and of "
        "`per_example_max_examples=None` coincide, every example was measured); exact = brute force over every "
        "example (`gns_callback.exact`). Ours through "
        "`GradientNoiseScaleMeter` only (the package's current defaults, read after the last step); peers as in "
        "`benchmarks/peers_gns.py` (nanoGNS `exact/gnstracking.py` + `exact/gns-analysis.py` @ b3b0c9c; gpt-neox "
        "`megatron/gradient_noise_scale/gradient_noise_scale.py` @ ea7aefd; AdaptDL "
        "`adaptdl/torch/gradient_noise_scale.py` @ 542e123), fed from the exact per-example gradients of each batch.",
        "",
        *case_lines(results),
        "",
        "Mean |relative error| ± its standard error over streams (pooled: over every case's streams; an infinite "
        "reading makes it inf), and the pooled median:",
        "",
        *_table(results, _abs_error, ("pooled median", _median_abs_error)),
        "",
        f"How often the 95% interval holds the exact value ({len(rows_with_interval)} estimators give one; the peers "
        "give none), and how many of those intervals have no upper end (they hold any value above their lower end):",
        "",
        *_table(_only(results, rows_with_interval), _coverage),
        "",
        "Mean signed relative error (bias; its standard error is about that of the |error| row above or larger):",
        "",
        *_table(results, _signed_error),
    ]
    return "\n".join(lines)


def _only(results: list[dict], names: list[str]) -> list[dict]:
    return [{**r, "streams": [{n: s[n] for n in names} for s in r["streams"]]} for r in results]


def main(argv: Optional[list[str]] = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="streams of batches per case (default 20)")
    parser.add_argument("--steps", type=int, default=400, help="steps per stream (default 400)")
    parser.add_argument("--quick", action="store_true", help="2 seeds × 60 steps: a smoke test, not a measurement")
    parser.add_argument("--out", default=None, help="write the tables into this RESULTS.md")
    parser.add_argument("--held-out", action="store_true",
                        help="the HELD_OUT cases instead (their own section), to see the defaults generalise")
    args = parser.parse_args(argv)
    seeds, steps = (2, 60) if args.quick else (args.seeds, args.steps)
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = run(seeds, steps, HELD_OUT if args.held_out else CASES)
    command = "python benchmarks/accuracy_peers.py" + (" --held-out" if args.held_out else "") + (
        " --quick" if args.quick else "") + "".join(
        f" --{k} {v}" for k, v, d in (("seeds", args.seeds, 20), ("steps", args.steps, 400)) if v != d and not args.quick)
    table = to_markdown(results, command + (f" --out {args.out}" if args.out else ""), seeds, steps,
                        time.perf_counter() - start)
    print(table)
    if args.out:
        replace_section(args.out, HELD_OUT_HEADING if args.held_out else HEADING, table)
    return table


if __name__ == "__main__":
    main()
