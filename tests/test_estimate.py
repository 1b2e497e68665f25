"""GNSEstimate: what a user reads, and how it reads back from the JSON report."""

import dataclasses
import math

from gns_callback.estimate import GNSEstimate

MEASURED = GNSEstimate(b_simple=60.0, grad_sq_norm=0.1, trace_sigma=6.0, ci_low=50.0, ci_high=75.0, confidence=0.95,
                       steps=100, skipped_steps=0, effective_steps=99.0, method="per_example", averaging="run")


def same(a: GNSEstimate, b: GNSEstimate) -> bool:
    pairs = [(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)]
    return all(x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)) for x, y in pairs)


def test_every_state_reads_back_from_json_as_it_was():
    """Before, a fit that measured no step (max_steps=0, limit_train_batches=0) and a report from before ``failure``
    existed read back as b_simple = inf, "unbounded", where the fit held nan, "not measured"."""
    nan, inf = math.nan, math.inf
    no_step = dataclasses.replace(MEASURED, b_simple=nan, grad_sq_norm=nan, trace_sigma=nan, ci_low=0.0, ci_high=inf,
                                  steps=0, effective_steps=0.0)
    states = [MEASURED, dataclasses.replace(MEASURED, ci_high=inf), dataclasses.replace(MEASURED, b_simple=inf,
              ci_low=0.0, ci_high=inf), MEASURED.not_measured("hooks stopped"), no_step]
    for est in states:
        assert same(GNSEstimate.from_dict(est.to_dict()), est), est
    old = {k: v for k, v in MEASURED.not_measured("x").to_dict().items() if k != "failure"}  # no "failure" key
    assert math.isnan(GNSEstimate.from_dict(old).b_simple)


def test_an_estimate_with_no_step_says_not_measured():
    """Before: "B_simple = nan (95% CI 0 – inf; |G|² = nan, tr(Σ) = nan; 0 steps, ...)"."""
    nan = math.nan
    no_step = dataclasses.replace(MEASURED, b_simple=nan, grad_sq_norm=nan, trace_sigma=nan, ci_low=0.0,
                                  ci_high=math.inf, steps=0)
    assert str(no_step).startswith("B_simple not measured (no optimizer step measured")
    assert str(MEASURED.not_measured("hooks stopped")) == "B_simple not measured (hooks stopped)"
