"""Smoke test of ``benchmarks/critical_batch_digits.py`` in quick mode: finite, consistent outputs.

No thresholds on the measured values beyond what the McCandlish model requires of any run (more examples per
step buy fewer steps at a higher example count, a positive critical batch); the comparison itself is in
RESULTS.md.
"""

from __future__ import annotations

import math

import numpy as np
import pytest


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("critical_batch_digits")


@pytest.fixture(scope="module")
def quick_run(bench):
    return bench.run_benchmark(quick=True, log=lambda message: None)


def test_steps_fall_and_examples_rise_with_batch(quick_run):
    results = quick_run["results"]
    batch = [r.batch_size for r in results]
    steps = [r.steps for r in results]
    examples = [b * s for b, s in zip(batch, steps)]
    assert batch == sorted(batch) and len(batch) >= 3
    assert all(math.isfinite(s) and s > 0 for s in steps)
    assert all(a > b for a, b in zip(steps, steps[1:])), steps
    assert all(a < b for a, b in zip(examples, examples[1:])), examples
    for r in results:
        assert r.tuned_lr in quick_run["cfg"].lrs
        assert all(math.isfinite(s) for s in r.seed_steps[r.tuned_lr])


def test_fits_are_positive_and_consistent(quick_run):
    for name in ("hyperbola", "linear"):
        fit = quick_run[name]
        assert fit["s_min"] > 0 and fit["b_crit"] > 0, (name, fit)
        assert math.isclose(fit["e_min"], fit["s_min"] * fit["b_crit"], rel_tol=1e-9)
    fit = quick_run["hyperbola"]
    # S_min lies below every measured S (the model's asymptote), and the fit reproduces the points roughly.
    for r in quick_run["results"]:
        assert fit["s_min"] < r.steps
        model = fit["s_min"] * (1 + fit["b_crit"] / r.batch_size)
        assert 0.5 < model / r.steps < 2.0
    lo, hi = quick_run["bootstrap"]["seeds"]
    assert 0 < lo <= hi


def test_callback_runs_and_recommendation(bench, quick_run):
    cfg = quick_run["cfg"]
    callbacks = quick_run["callbacks"]
    assert {(c["batch_size"], c["seed"]) for c in callbacks} == (
        {(b, 0) for b in cfg.callback_batches} | {(cfg.primary_batch, k) for k in range(cfg.seeds)}
    )
    for cb in callbacks:
        run, ema = cb["run"], cb["ema"]
        assert run.steps > 0 and math.isfinite(run.b_simple) and run.b_simple > 0
        assert run.ci_low <= run.b_simple <= run.ci_high
        assert math.isfinite(ema.b_simple) and ema.b_simple > 0
        assert cb["history"] and all(h["step"] <= cb["steps"] for h in cb["history"])
        # The Lightning replay follows the plain loop's trajectory: it ends near the target loss.
        assert cb["final_loss"] < 1.5 * cfg.target_loss
        rec = cb["recommendation"]
        assert rec.batch_size >= 1 and rec.learning_rate > 0
        land = bench.landing(quick_run, rec.batch_size)
        assert land["model_s"] > 1 and land["model_e"] > 1
        assert np.isclose((land["model_s"] - 1) * (land["model_e"] - 1), 1.0)
    cmp_ = bench.comparison(quick_run)
    assert cmp_["best"] in cmp_["summary"] and cmp_["runs"] == len(cfg.callback_batches)


def test_exact_values_along_the_run(quick_run):
    for b, ex in quick_run["exact"].items():
        check = ex["check"]  # closed-form per-example norms against the brute-force reference
        assert math.isclose(check["closed_form"], check["reference"], rel_tol=1e-4)
        assert len(ex["per_step"]) == ex["steps"] and all(v > 0 for v in ex["per_step"])
        assert ex["run_ratio"] > 0 and ex["ema_final"] > 0
        assert ex["checkpoints"] and all(math.isfinite(c["ghg"]) for c in ex["checkpoints"])
        # The callback's run average estimates the exact ratio of cumulative sums on the same trajectory.
        cb = next(c for c in quick_run["callbacks"] if c["batch_size"] == b and c["seed"] == 0)
        assert 0.25 < cb["run"].b_simple / ex["run_ratio"] < 4


def test_render_and_plot(bench, quick_run, tmp_path):
    section = bench.render(quick_run, "python benchmarks/critical_batch_digits.py --quick", figure_link="fig.png")
    assert "| B | tuned LR |" in section and "B_crit" in section and "![" in section
    assert "Reading" in bench.interpretation(quick_run)  # the full run's text builds from any run's numbers
    png = tmp_path / "fig.png"
    bench.plot(quick_run, str(png))
    assert png.stat().st_size > 1000
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\n## Other\n\nkeep me\n")
    from benchmarks.results import replace_section

    replace_section(str(path), bench.SECTION_HEADING, section)
    replace_section(str(path), bench.SECTION_HEADING, section)
    text = path.read_text()
    assert text.count(bench.SECTION_HEADING) == 1 and "## Other\n\nkeep me" in text
