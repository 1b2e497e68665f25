import re

import pytest

pytest.importorskip("matplotlib")

from gns_callback.plots import plot_probe  # noqa: E402
from gns_callback.probe import ProbeResult  # noqa: E402
from tests.plots.figure_checks import draw, legend_box, legend_labels, texts, tick_labels  # noqa: E402

UNITS = re.compile(r"\b(GiB|MiB|KiB)\b")


def measured_extent(fig, ax) -> float:
    """Fraction of the panel's height between the lowest and the highest measured point, as drawn."""
    draw(fig)
    (points,) = [ln for ln in ax.get_lines() if ln.get_label() == "measured (fits)"]
    ys = ax.transData.transform(list(zip(points.get_xdata(), points.get_ydata())))[:, 1]
    panel = ax.get_window_extent()
    return (ys.max() - ys.min()) / panel.height


def test_cpu_probe_memory_is_not_flat_against_the_budget(cpu_probe):
    """0.3–87 MiB measured against a 22.9 GiB budget: on log axes the points span the panel, the budget still
    shown."""
    fig = plot_probe(cpu_probe)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log" and ax.get_xscale() == "log"
    assert measured_extent(fig, ax) > 0.4
    assert any(label.startswith("budget 22.9 GiB") for label in legend_labels(ax))


def test_the_old_linear_layout_would_have_been_caught(cpu_probe):
    """The extent check fails on a linear axis from 0 to the budget, the layout before the fix."""
    fig = plot_probe(cpu_probe)
    ax = fig.axes[0]
    ax.set_yscale("linear")
    ax.set_ylim(0, 24597403688 / 2**20)
    assert measured_extent(fig, ax) < 0.01


def test_a_far_budget_on_linear_axes_is_stated_in_words(gpu_probe):
    far = {**gpu_probe, "budget_bytes": 80 * 2**30, "trials": [t for t in gpu_probe["trials"] if t["ok"]]}
    fig = plot_probe(far)
    ax = fig.axes[0]
    assert ax.get_yscale() == "linear"
    assert measured_extent(fig, ax) > 0.4
    (note,) = [t for t in ax.texts if "budget" in t.get_text()]
    assert note.get_text().startswith("budget 80 GiB (usable 72 GiB)") and "off the scale" in note.get_text()
    assert not [label for label in legend_labels(ax) if label.startswith("budget")]


def test_a_near_budget_is_drawn_with_the_usable_part(gpu_probe):
    ax = plot_probe(gpu_probe).axes[0]
    labels = legend_labels(ax)
    assert "budget 8 GiB" in labels and "usable: 0.9 × budget = 7.2 GiB" in labels
    assert ax.get_ylim()[1] > 8  # GiB: the budget line is inside the panel
    assert "out of memory (drawn at the budget)" in labels


@pytest.mark.parametrize("probe_name, expected", [("cpu_probe", "fit: 306 KiB + 1.3 KiB/sample"),
                                                  ("gpu_probe", "fit: 1,229 MiB + 40 MiB/sample")])
def test_fit_label_uses_one_unit(probe_name, expected, request):
    ax = plot_probe(request.getfixturevalue(probe_name)).axes[0]
    (fit,) = [label for label in legend_labels(ax) if label.startswith("fit:")]
    assert fit == expected and len(set(UNITS.findall(fit))) == 1


def test_capped_search_is_said(cpu_probe, gpu_probe):
    capped = legend_labels(plot_probe(cpu_probe).axes[0])
    assert ("largest size tried: 65536 (the probe's upper limit on sizes; memory was not the limit)") in capped
    fits = legend_labels(plot_probe(gpu_probe).axes[0])
    assert "largest micro-batch that fits: 128" in fits and not [t for t in fits if "upper limit" in t]


def test_axis_labels_say_how_memory_was_measured(cpu_probe, gpu_probe):
    assert plot_probe(cpu_probe).axes[0].get_ylabel() == "peak memory (MiB; tensor bytes counted)"
    assert plot_probe(gpu_probe).axes[0].get_ylabel() == "peak memory (GiB; allocator peak)"
    _, bx = plot_probe(gpu_probe).axes
    assert bx.get_xlabel() == "micro-batch size (per device)" and bx.get_ylabel() == "samples / s (per device)"


def test_chosen_micro_batch_is_starred_and_interpolation_said(cpu_probe):
    _, bx = plot_probe(cpu_probe, chosen_micro_batch=56).axes
    assert "recommended micro-batch: 56 (interpolated)" in legend_labels(bx)
    _, bx = plot_probe(cpu_probe, chosen_micro_batch=64).axes
    assert "recommended micro-batch: 64" in legend_labels(bx)
    _, bx = plot_probe(cpu_probe).axes
    assert "fastest that fits: 1024" in legend_labels(bx)


def test_legends_below_the_panels_and_plain_ticks(cpu_probe):
    fig = plot_probe(cpu_probe, chosen_micro_batch=56)
    for ax in fig.axes:
        assert legend_box(fig, ax).y1 < ax.get_window_extent().y0
    labels = tick_labels(fig)
    assert "65,536" in labels and not [t for t in labels if "times" in t or "$" in t or "e+" in t]


def test_partial_probes_and_old_formats(gpu_probe):
    thr_only = {"max_micro_batch": 128, "throughput": gpu_probe["throughput"], "trials": []}
    assert plot_probe(thr_only).axes[0].texts[0].get_text() == "no memory measured"
    mem_only = {**gpu_probe, "throughput": [], "trials": [{**t, "samples_per_s": None} for t in gpu_probe["trials"]]}
    assert plot_probe(mem_only).axes[1].texts[0].get_text() == "no throughput measured"
    # Trials as [size, ok, bytes, samples/s] lists and no fit: points still drawn, throughput from the trials.
    trials = [[16, True, 2e9, 900.0], [64, True, 4e9, 1500.0]]
    old = {"max_micro_batch": 64, "budget_bytes": 8 * 2**30, "trials": trials}
    ax, bx = plot_probe(old).axes
    (points,) = [ln for ln in ax.get_lines() if ln.get_label() == "measured (fits)"]
    assert list(points.get_xdata()) == [16, 64] and list(bx.get_lines()[0].get_xdata()) == [16, 64]
    assert plot_probe(None) is None and plot_probe({"trials": []}) is None


def test_a_probe_result_object_draws_like_its_dict(gpu_probe):
    fig = plot_probe(ProbeResult.from_dict(gpu_probe))
    assert texts(fig) == texts(plot_probe(gpu_probe))
