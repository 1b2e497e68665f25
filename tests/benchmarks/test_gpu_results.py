"""The GPU benchmarks run only on a GPU; their saved results (benchmarks/gpu_results/) render on any machine, and
the rendered tables carry the measured numbers (so the scripts' CPU-side code cannot rot unnoticed)."""

import json
import pathlib

from benchmarks import gpu_overhead, gpu_probe_truth

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_results"


def test_probe_truth_renders_the_truth_and_the_probes_error():
    run = json.loads((RESULTS / "probe_truth_h100.json").read_text())
    section = gpu_probe_truth.render(run, "cmd")
    for row in run["truth"]:
        assert f"| {row['case']} | {row['truth']['max']} |" in section
        for probe in row["probe"]:
            assert f"{probe['error']:+.1%}" in section
    assert "H100" in section


def test_overhead_renders_every_ratio_with_its_rounds():
    run = json.loads((RESULTS / "overhead_h100_after.json").read_text())
    section = gpu_overhead.render(run, run["command"])
    ratios = [row for row in run["rows"] if "ratio" in row]
    assert ratios and all(f"**{row['ratio']:.3f}×**" in section for row in ratios)
    assert run["command"] in section
