"""Issue 10 item 8: ``auto`` picked ``per_example`` for models whose per-example norms hooks can't measure, and the
first backward crashed, even with ``accumulate_grad_batches=2`` where ``micro_batch`` works. Now the hooks record
the problem; under ``auto`` with several micro-batches per step the meter switches to ``micro_batch`` at the first
failed step (warning once) and measures the whole model; with one micro-batch it withholds the estimate with the
reason and the fix. A position table shared by every example (``wpe(arange(T))``) was among them; it is now read
where its rows are broadcast over the batch, and measured whole."""

import pytest
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.models import ConvTwice, LinearOnLearnedTable, PooledPositions, PositionalEmbedding
from tests.trust.setups import assert_withheld, messages, single, with_and_without

STEPS = 150
MODELS = {"conv_twice": ConvTwice, "positional_embedding": PositionalEmbedding,
          "linear_on_learned_table": LinearOnLearnedTable, "pooled_positions": PooledPositions}
UNMEASURABLE = ("linear_on_learned_table", "conv_twice")
WHY = {"conv_twice": "applied more than once", "linear_on_learned_table": "module 'net.project'"}
TOKENS = ("positional_embedding", "pooled_positions")


@pytest.fixture(scope="module")
def data(digits):
    """Pixels for the dense models, pixel intensities as 64 tokens for the embedding model."""
    x, y = digits
    return {"pixels": (x, y), "tokens": ((x * 16).round().long(), y)}


def inputs(data, name):
    return data["tokens" if name in TOKENS else "pixels"]


def run(data, name, accumulate, batch_size, steps):
    x, y = inputs(data, name)
    callback = GradientNoiseScaleCallback(verbose=False)  # method="auto"
    _, caught = with_and_without(
        lambda: Classifier(MODELS[name]()),
        lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * steps, seed=0),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught


@pytest.mark.parametrize("name", UNMEASURABLE)
def test_auto_switches_to_micro_batch_and_matches_the_exact_value(data, exact_gns, name):
    callback, caught = run(data, name, accumulate=4, batch_size=8, steps=STEPS)
    switched = single(messages(caught, "switched from method='per_example' to 'micro_batch'"))
    assert WHY[name] in switched
    assert not messages(caught, "stopped measuring")
    run_estimate = callback.run_estimate
    assert run_estimate.method == "micro_batch" and run_estimate.steps == STEPS - 1  # from the step after the switch
    assert_matches_exact(run_estimate, exact_gns(MODELS[name](), F.cross_entropy, *inputs(data, name))[0])


@pytest.mark.parametrize("name", UNMEASURABLE)
def test_one_micro_batch_per_step_withholds_with_the_reason_and_the_fix(data, name):
    callback, caught = run(data, name, accumulate=1, batch_size=32, steps=10)
    assert_withheld(callback.run_estimate, WHY[name], "method='micro_batch'", "accumulate_grad_batches=2")
    assert_withheld(callback.estimate)
    single(messages(caught, "stopped measuring"))


@pytest.mark.parametrize("name", TOKENS)
@pytest.mark.parametrize("accumulate, batch_size", [(1, 32), (1, 64), (4, 8)])
def test_a_position_table_looked_up_on_arange_is_measured_whole(data, exact_gns, name, accumulate, batch_size):
    """nanoGPT's ``wpe(torch.arange(T))``: the table's output is broadcast over the batch, so its own output
    gradient is summed over the examples already; its rows are read at the broadcast instead, by the module that
    calls it. Before, the table was left out (9% of
    ``positional_embedding``) or, at 68% of ``pooled_positions``, the run was not measured. At 64 positions in a
    batch of 64 the table's (64, d) output gradient has the batch's shape: it is not read as one."""
    callback, caught = run(data, name, accumulate, batch_size, STEPS)
    assert not messages(caught, "stopped measuring") and not messages(caught, "switched from")
    assert not messages(caught, "left the")
    run_estimate = callback.run_estimate
    assert run_estimate.method == "per_example" and run_estimate.steps == STEPS
    assert_matches_exact(run_estimate, exact_gns(MODELS[name](), F.cross_entropy, *inputs(data, name))[0])
    assert callback.meter.coverage["fraction"] == 1.0 and not callback.meter.coverage["uncovered"]
