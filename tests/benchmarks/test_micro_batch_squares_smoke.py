"""Smoke test of ``benchmarks/micro_batch_squares.py --quick``: both policies run and give finite positive times;
the policy switch leaves the collector's size rule as it found it. No timing thresholds (RESULTS.md holds them)."""

import math

from gns_callback.collectors import micro_batch


def test_quick_run_gives_a_row_per_model_and_loop(load_benchmark):
    rule = micro_batch._hot_on_cpu
    text = load_benchmark("micro_batch_squares").main(["--quick", "--rounds", "1", "--steps", "2"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and "ms/step" not in line]
    assert [row.split(" | ")[:2] for row in rows] == [["| MLP", "Lightning"], ["| MLP", "plain"],
                                                       ["| CNN", "Lightning"], ["| CNN", "plain"],
                                                       ["| Transformer", "Lightning"], ["| Transformer", "plain"]]
    for row in rows:
        base = float(row.split(" | ")[2])
        assert math.isfinite(base) and base > 0
    assert micro_batch._hot_on_cpu is rule
