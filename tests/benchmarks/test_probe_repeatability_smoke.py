"""Smoke test of ``benchmarks/probe_repeatability.py``: a short configuration runs and its table reads back.

No agreement threshold here: repeatability is a property of the machine as much as of the probe, measured by
the benchmark itself (RESULTS.md).
"""

from __future__ import annotations

import torch

from gns_callback.probe import ProbeConfig


def test_runs_are_summarised_per_size(load_benchmark):
    bench = load_benchmark("probe_repeatability")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outcome = bench.run_config("quick", ProbeConfig(timing_budget_s=0.05), runs=2)
    finally:
        torch.set_num_threads(previous)
    assert set(outcome["sizes"]) == set(bench.SIZES) and len(outcome["wall"]) == 2
    for stats in outcome["sizes"].values():
        assert len(stats["rates"]) == 2 and all(r > 0 for r in stats["rates"]) and stats["ratio"] >= 1.0
        assert min(stats["repeats"]) >= 6  # the default minimum: every size has an interval
    text = bench.render([outcome], "python benchmarks/probe_repeatability.py --quick", ("0", "0"), runs=2)
    assert "| 512 |" in text and "Runs agree" in text
