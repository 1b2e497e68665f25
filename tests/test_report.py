"""The JSON report file: written strict, read back with errors that name the file and the fix."""

import json

import pytest

from gns_callback.report import load_estimate


@pytest.mark.parametrize("content, section, problem", [
    ({"loss": 0.3}, "estimate", "has no such estimate section (estimate sections: none)"),
    ([1, 2], "estimate", "has no such estimate section"),
    ({"estimate": {"b_simple": 50.0, "ci_low": 40.0, "ci_high": 60.0}}, "estimate", "lacks an estimate's fields"),
    ({"estimate": {"b_simple": 50.0}}, "run_estimate", "estimate sections: estimate"),
])
def test_a_file_that_holds_no_such_estimate_is_named_with_the_fix(tmp_path, content, section, problem):
    """Before: a bare KeyError ('estimate', 'grad_sq_norm') or TypeError."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match="load_estimate") as err:
        load_estimate(path, section)
    assert problem in str(err.value) and str(path) in str(err.value)
    assert "pass a gns_report.json that GradientNoiseScaleCallback wrote" in str(err.value)
