import sys

import pytest

pytest.importorskip("matplotlib")

from gns_callback.plots import axes  # noqa: E402


@pytest.mark.parametrize(
    "lo, hi, expected",
    [
        (20, 1500, [20, 50, 100, 200, 500, 1000]),  # 1-2-5 once a decade alone gives fewer than 3
        (1, 40, [1, 2, 5, 10, 20]),
        (0.5, 500, [1, 10, 100]),
        (25, 45, [25, 30, 40]),  # less than a decade: every digit (1.2 and 2.5 included)
    ],
)
def test_log_ticks_pick_the_coarsest_set_with_three_ticks(lo, hi, expected):
    assert axes.log_ticks(lo, hi) == expected


def test_log_ticks_fall_back_to_plain_values_on_a_very_narrow_range():
    ticks = axes.log_ticks(50.2, 51.8)
    assert len(ticks) >= 2 and all(50.2 <= t <= 51.8 for t in ticks)


@pytest.mark.parametrize("value, text", [(30, "30"), (1.5, "1.5"), (0.02, "0.02"), (1000, "1,000"), (8192, "8,192"),
                                         (20000, "20,000"), (65536, "65,536"), (1.2e6, "1,200,000")])
def test_plain_number_never_uses_scientific_notation(value, text):
    assert axes.plain_number(value) == text


def test_byte_units_and_one_unit_per_number():
    assert axes.byte_unit(313468) == ("KiB", 1024)
    assert axes.byte_unit(1.2 * 2**30) == ("GiB", 2**30)
    assert axes.byte_unit(12) == ("B", 1) and axes.byte_unit(0) == ("B", 1)
    assert axes.in_unit(313468, ("KiB", 1024)) == "306 KiB"
    assert axes.in_unit(1.2 * 2**30, ("MiB", 2**20)) == "1,229 MiB"
    assert axes.in_unit(1328, ("KiB", 1024)) == "1.3 KiB"


def test_power_of_two_ticks_thin_out_long_ranges():
    assert axes.power_of_two_ticks(1, 100) == [1, 2, 4, 8, 16, 32, 64]
    many = axes.power_of_two_ticks(1, 2**20, max_ticks=10)  # 21 powers: every third one
    assert many == [1, 8, 64, 512, 4096, 32768, 262144]


def test_status_line_wraps_and_needs_a_status():
    assert axes.status_line(None, "why") is None
    text = axes.status_line("too_wide", "word " * 60, width=80)
    assert text.startswith("Status: too_wide — word") and all(len(line) <= 80 for line in text.splitlines())


def test_a_figure_without_matplotlib_names_the_extra(monkeypatch):
    """Before: ``ModuleNotFoundError: No module named 'matplotlib'``, with no word on the ``plots`` extra."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not installed: any import of it fails
    with pytest.raises(ImportError, match=r"pip install 'gns_callback\[plots\]'"):
        axes.figure(4, 3)
