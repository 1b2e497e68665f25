"""``benchmarks/accuracy_peers.py``: its scores on hand-made readings, the wiring of the meter to the same batches
the peers see, and ``--quick`` end to end (no accuracy thresholds: those are the benchmark's to report)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gns_callback.estimators import grad_sq_norm_estimate, trace_sigma_estimate
from gns_callback.exact import per_example_gradients


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("accuracy_peers")


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _result(bench, exact: float, readings: list) -> dict:
    return {"case": bench.CASES[0], "exact": exact, "streams": [{"a": r} for r in readings]}


def test_scores_on_hand_made_readings(bench):
    result = _result(bench, 10.0, [bench.Reading(12.0, 9.0, 15.0), bench.Reading(20.0, 11.0, math.inf),
                                   bench.Reading(10.0, 2.0, math.inf)])
    assert bench.relative_errors(result, "a") == pytest.approx([0.2, 1.0, 0.0])
    assert bench.coverage(result, "a") == (2, 3)
    assert bench._coverage([result], "a") == "2/3 (2 unbounded)"
    assert bench._median_abs_error([result], "a") == "0.200"
    mean, se = bench.mean_and_se([0.2, 1.0, 0.0])
    assert mean == pytest.approx(0.4) and se == pytest.approx(torch.tensor([0.2, 1.0, 0.0]).std().item() / 3**0.5)
    assert bench.coverage(_result(bench, 10.0, [bench.Reading(11.0)]), "a") is None  # no interval: a peer


def test_micro_batch_run_average_is_the_ratio_of_step_means_on_the_same_batches(bench, one_thread):
    """The meter, driven as the benchmark drives it (4 passes of 8, loss / 4), sees exactly the stream's batches:
    its run average equals mean tr Σ̂ / mean |Ĝ|² computed from the exact per-example rows of those batches."""
    case = bench.CASES[1]
    x, y = case.data()
    model = bench.frozen_model(case, x, y, steps=20)
    rows = per_example_gradients(model, F.cross_entropy, x, y)
    batches = torch.randint(0, x.shape[0], (30, bench.BATCH), generator=torch.Generator().manual_seed(5))
    _, run = bench.run_ours(model, x, y, batches, {"method": "micro_batch"}, bench.MICRO)
    batch_rows = rows[batches]  # (steps, 32, P)
    big = batch_rows.mean(1).pow(2).sum(-1)
    small = batch_rows.reshape(30, 4, 8, -1).mean(2).pow(2).sum(-1).mean(-1)
    expected = (trace_sigma_estimate(small, big, 8, 32).mean() / grad_sq_norm_estimate(small, big, 8, 32).mean())
    assert run.estimate == pytest.approx(expected.item(), rel=1e-4)
    assert run.low <= run.estimate <= run.high


def test_quick_run_end_to_end(bench, one_thread, tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# Benchmark results\n\n## Another section\n\nkept\n")
    table = bench.main(["--quick", "--out", str(out)])
    for name in [f"{label}: {read}" for label in bench.OURS for read, _ in bench.READS] + list(bench.PEERS):
        assert sum(line.startswith(f"| {name} |") for line in table.splitlines()) == (3 if name not in bench.PEERS
                                                                                      else 2)
    text = out.read_text()
    assert bench.HEADING in text and "kept" in text and "--quick" in text
    exact_values = [float(line.split("|")[5]) for line in table.splitlines() if line.startswith(("| bc:", "| wine:",
                                                                                                 "| cnn:"))]
    assert len(exact_values) == 3 and all(v > 0 for v in exact_values)


def test_held_out_cases_write_their_own_section(bench, one_thread, tmp_path, monkeypatch):
    """``--held-out`` scores the HELD_OUT cases (two of them here, to stay quick) under their own heading, leaving
    the main section alone."""
    monkeypatch.setattr(bench, "HELD_OUT", bench.HELD_OUT[:2])
    out = tmp_path / "RESULTS.md"
    out.write_text(f"# Benchmark results\n\n{bench.HEADING}\n\nkept\n")
    table = bench.main(["--held-out", "--quick", "--out", str(out)])
    assert all(f"| {case.key}: {case.name} |" in table for case in bench.HELD_OUT)
    text = out.read_text()
    assert bench.HELD_OUT_HEADING in text and "kept" in text and "--held-out" in text
