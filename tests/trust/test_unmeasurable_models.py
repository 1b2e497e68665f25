"""Issue 10 item 8: ``auto`` picked ``per_example`` for models whose per-example norms hooks can't measure, and the
first backward crashed, even with ``accumulate_grad_batches=2`` where ``micro_batch`` works. Now the hooks record
the problem; under ``auto`` with several micro-batches per step the meter switches to ``micro_batch`` at the first
failed step (warning once) and measures the whole model; with one micro-batch it withholds the estimate with the
reason and the fix."""

import pytest
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.models import LinearOnLearnedTable, LinearTwice, PositionalEmbedding
from tests.trust.setups import assert_withheld, messages, single, with_and_without

STEPS = 150
MODELS = {"linear_twice": LinearTwice, "positional_embedding": PositionalEmbedding,
          "linear_on_learned_table": LinearOnLearnedTable}
WHY = {"linear_twice": "applied more than once", "positional_embedding": "its indices are arange(...) with no batch",
       "linear_on_learned_table": "module 'net.project'"}


@pytest.fixture(scope="module")
def data(digits):
    """Pixels for the dense models, pixel intensities as 64 tokens for the embedding model."""
    x, y = digits
    return {"pixels": (x, y), "tokens": ((x * 16).round().long(), y)}


def inputs(data, name):
    return data["tokens" if name == "positional_embedding" else "pixels"]


def run(data, name, accumulate, batch_size, steps):
    x, y = inputs(data, name)
    callback = GradientNoiseScaleCallback(verbose=False)  # method="auto"
    _, caught = with_and_without(
        lambda: Classifier(MODELS[name]()),
        lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * steps, seed=0),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught


@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_switches_to_micro_batch_and_matches_the_exact_value(data, exact_gns, name):
    callback, caught = run(data, name, accumulate=4, batch_size=8, steps=STEPS)
    switched = single(messages(caught, "switched from method='per_example' to 'micro_batch'"))
    assert WHY[name] in switched
    assert not messages(caught, "stopped measuring")
    run_estimate = callback.run_estimate
    assert run_estimate.method == "micro_batch" and run_estimate.steps == STEPS - 1  # from the step after the switch
    assert_matches_exact(run_estimate, exact_gns(MODELS[name](), F.cross_entropy, *inputs(data, name))[0])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_one_micro_batch_per_step_withholds_with_the_reason_and_the_fix(data, name):
    callback, caught = run(data, name, accumulate=1, batch_size=32, steps=10)
    assert_withheld(callback.run_estimate, WHY[name], "method='micro_batch'", "accumulate_grad_batches=2")
    assert_withheld(callback.estimate)
    single(messages(caught, "stopped measuring"))


def test_a_position_table_as_long_as_the_batch_is_withheld_not_misread(data):
    """64 positions at batch 64: the table's (64, d) gradient has the batch's shape. Read as a batch it would give
    wrong per-example norms; the run is withheld with the reason and the fix instead."""
    callback, caught = run(data, "positional_embedding", accumulate=1, batch_size=64, steps=5)
    assert_withheld(callback.run_estimate, WHY["positional_embedding"], "expand(batch_size, -1)", "method='micro_batch'")
    single(messages(caught, "stopped measuring"))
