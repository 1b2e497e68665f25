"""json_safe: what the report may hold is strict JSON."""

import json
import math

import numpy as np

from gns_callback.json_values import json_safe


def test_non_finite_numbers_become_null_and_numpy_numbers_plain_ones():
    value = {"a": math.inf, "b": [math.nan, 1.5, (2, np.int64(3))], "c": np.float32(0.25), "d": np.float64(np.inf),
             "e": True, "f": None, "g": "x", "h": np.int32(-4)}
    safe = json_safe(value)
    assert safe == {"a": None, "b": [None, 1.5, [2, 3]], "c": 0.25, "d": None, "e": True, "f": None, "g": "x", "h": -4}
    assert type(safe["b"][2][1]) is int and type(safe["c"]) is float and type(safe["h"]) is int
    json.dumps(safe, allow_nan=False)  # strict: no NaN or Infinity tokens, nothing json can't write


def test_the_report_file_is_strict_json_whatever_a_section_holds(tmp_path):
    from gns_callback.report import read_report, write_report

    path = write_report(tmp_path / "r.json", {"coverage": {"left_out_gradient_share": math.inf},
                                              "config": {"max_batch_size": np.int64(512)}})
    assert read_report(path)["coverage"]["left_out_gradient_share"] is None
    assert read_report(path)["config"]["max_batch_size"] == 512
