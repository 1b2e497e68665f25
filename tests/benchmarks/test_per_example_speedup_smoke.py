"""Smoke test of ``benchmarks/per_example_speedup.py --quick``: old and new layer functions give the same norms.

No timing thresholds: the speed-up is measured by the benchmark itself (RESULTS.md).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def speedup(load_benchmark):
    return load_benchmark("per_example_speedup")


def _in_a_git_checkout() -> bool:
    import shutil
    import subprocess

    if shutil.which("git") is None:
        return False
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_a_git_checkout(), reason="compares against HEAD's layer functions: needs a git checkout")
def test_quick_run_against_head_agrees(speedup):
    table = speedup.run("HEAD", None, steps=2, warmup=1, quick=True)
    rows = [line.split(" | ") for line in table.splitlines()[2:]]
    assert [row[0].strip("| ") for row in rows] == ["MLP", "CNN", "Transformer"]
    for row in rows:
        assert float(row[-1].strip(" |")) < 1e-5  # max rel. diff of the per-example norms, old vs new
