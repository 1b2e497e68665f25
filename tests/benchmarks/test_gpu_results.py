"""The GPU benchmarks run only on a GPU; their saved results (benchmarks/gpu_results/) render on any machine, and
the rendered tables carry the measured numbers (so the scripts' CPU-side code cannot rot unnoticed)."""

import json
import pathlib

import pytest
import torch

from benchmarks import gpu_conv_paths, gpu_overhead, gpu_probe_truth

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_results"


@pytest.mark.parametrize("name, device", [("probe_truth_h100.json", "H100"), ("probe_truth_h200.json", "H200")])
def test_probe_truth_renders_the_truth_and_the_probes_error(name, device):
    run = json.loads((RESULTS / name).read_text())
    section = gpu_probe_truth.render(run, "cmd")
    for row in run["truth"]:
        assert f"| {row['case']} | {row['truth']['max']} |" in section
        for probe in row["probe"]:
            assert f"{probe['error']:+.1%}" in section
    assert device in section


@pytest.mark.parametrize("name", ["overhead_h100_after.json", "gpu_overhead_h200.json", "overhead_h200_new_round1.json",
                                  "overhead_h200_old_round1.json"])
def test_overhead_renders_every_ratio_with_its_rounds(name):
    run = json.loads((RESULTS / name).read_text())
    section = gpu_overhead.render(run, run["command"])
    ratios = [row for row in run["rows"] if "ratio" in row]
    assert ratios and all(f"**{row['ratio']:.3f}×**" in section for row in ratios)
    assert run["command"] in section


def test_an_unknown_model_name_is_refused_before_anything_runs():
    """``--models transformer`` (the model is named "Transformer") would otherwise measure nothing for it."""
    with pytest.raises(ValueError, match=r"no model named \['transformer'\].*'Transformer'"):
        gpu_overhead.run(1, 1, 1, models=["MLP", "transformer"])


@pytest.mark.parametrize("name", ["conv_paths_h200_before.json", "conv_paths_h200_after.json",
                                  "conv_paths_h200_large.json"])
def test_conv_paths_render_every_layer_time_and_fit_ratio(name):
    run = json.loads((RESULTS / name).read_text())
    section = gpu_conv_paths.render(run)
    for row in run["layers"]:
        assert all(f"{ms:.3f}" in section for ms in row["ms"].values())
    assert all(f"**{row['ratio']:.3f}×**" in section for row in run.get("fit", ()) if "ratio" in row)
    for row in run.get("sequences", ()):
        assert all(f"{ms:.3f}" in section for ms in row["ms"].values())
    assert "H200" in section


def test_conv_paths_agree_on_the_norms_they_compute_exactly():
    """The exact paths the GPU script times give the same norms (the sketched ones are unbiased, tested apart)."""
    torch.manual_seed(0)
    module = torch.nn.Conv2d(8, 4, 3, stride=2, padding=1)
    x = torch.randn(4, 8, 8, 8)
    paths = gpu_conv_paths.layer_paths(module, x, torch.randn_like(module(x)))
    torch.testing.assert_close(paths["grouped conv, exact"](), paths["im2col, exact"]())
