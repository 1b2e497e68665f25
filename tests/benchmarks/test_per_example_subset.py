"""Smoke test of benchmarks/per_example_subset.py: the forced subset is what gets measured."""

import copy

from benchmarks.overhead import batch_pool, model_specs
from benchmarks.per_example_subset import TrackerStep


def test_forced_subset_measures_max_examples_and_default_measures_all_on_an_mlp():
    spec = next(s for s in model_specs(quick=True) if s.name == "MLP")
    net = spec.build()
    x, y = batch_pool(spec, size=1)[0]
    forced = TrackerStep(spec, copy.deepcopy(net), 2, force_subset=True)
    default = TrackerStep(spec, copy.deepcopy(net), 2)
    assert forced(x, y).shape == (2,) and forced.subset_passes == 1
    assert default(x, y).shape == (x.shape[0],) and default.subset_passes == 0
