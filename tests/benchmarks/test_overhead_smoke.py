"""Smoke test of ``benchmarks/overhead.py --quick``: it runs and yields finite positive ratios.

No timing thresholds here: the overhead targets are checked by the benchmark itself (RESULTS.md).
"""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def overhead(load_benchmark):
    return load_benchmark("overhead")


@pytest.fixture(scope="module")
def quick_run(overhead):
    return overhead.run_benchmark(quick=True, log=lambda message: None)


def test_quick_run_gives_finite_positive_ratios(quick_run):
    results = quick_run["results"]
    assert {r.model for r in results} == {"MLP", "CNN", "Transformer"}
    keys = {r.key for r in results if r.loop == "Lightning" and r.baseline_key}
    assert {"per_example", "micro_batch"} <= keys  # (+ "per_example_all" where the callback subsamples)
    for key in keys:
        rows = [r for r in results if r.loop == "Lightning" and r.key == key]
        assert len(rows) == 3
        for row in rows:
            assert row.status == "ok"
            assert row.ratio is not None and math.isfinite(row.ratio) and row.ratio > 0, (row.model, key, row.ratio)
            assert row.cpu_ratio is not None and math.isfinite(row.cpu_ratio) and row.cpu_ratio > 0
            assert row.info["measured_steps"] > 0  # the callback really measured during the timed fit
            assert all(t > 0 for t in row.times)
    tracker_rows = [r for r in results if r.key == "gns_tracker"]
    assert tracker_rows and all(r.ratio is not None and math.isfinite(r.ratio) and r.ratio > 0 for r in tracker_rows)


def test_peers_agree_or_are_reported(quick_run):
    for row in quick_run["results"]:
        if row.loop != "plain" or row.key == "plain":
            continue
        assert row.status == "ok" or row.status.startswith("unsupported: "), row.status
        if "max_rel_diff_vs_torch_func" in row.info:
            assert row.info["max_rel_diff_vs_torch_func"] < 1e-3, (row.model, row.key, row.info)


def test_section_replaced_and_other_sections_kept(overhead, quick_run, tmp_path):
    section = overhead.render(quick_run, "python benchmarks/overhead.py --quick")
    assert section.startswith(overhead.SECTION_HEADING)
    assert "| MLP |" in section and "| per_example" in section and "| micro_batch, accumulate=4 |" in section
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\n## Other\n\nkeep me\n")
    overhead.write_section(path, section)
    overhead.write_section(path, section.replace("| MLP |", "| MLP2 |"))  # second write replaces, not appends
    text = path.read_text()
    assert text.count(overhead.SECTION_HEADING) == 1 and "| MLP2 |" in text and "| MLP |" not in text
    assert "## Other\n\nkeep me" in text
    path.write_text(f"# Results\n\n{section}\n## Later\n\nalso kept\n")
    overhead.write_section(path, section)
    assert path.read_text().count(overhead.SECTION_HEADING) == 1 and "## Later\n\nalso kept" in path.read_text()


def test_profile_mode_runs(overhead):
    """``--profile`` wraps the callback's methods; it broke silently when their signatures changed."""
    text = overhead.profile_per_example(quick=True, models=["MLP"], steps=3, warmup=1)
    assert "Lightning `per_example`" in text and "Lightning `micro_batch`" in text
