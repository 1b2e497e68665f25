"""Issue 10 item 1: sequence-first models. ``nn.TransformerEncoderLayer`` defaults to ``batch_first=False``; taking
dim 0 as the batch measured per-position norms (2.7 [2.5, 2.9] against an exact 35.9). Each hooked layer's batch
dim is now checked against the batch size read off the batch, ``(T, B, ...)`` inputs are measured along dim 1, and
a layout that can't be told is refused (not measured, with the reason)."""

import pytest
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, assert_matches_exact, with_replacement_loader
from tests.trust.models import SequenceFirstEncoder
from tests.trust.setups import assert_withheld, messages, single, with_and_without

STEPS = 150


def run(digits, batch_size, accumulate=1, freeze_attention=True, method="per_example", steps=STEPS):
    x, y = digits
    callback = GradientNoiseScaleCallback(method=method, verbose=False)
    trainer, caught = with_and_without(
        lambda: Classifier(SequenceFirstEncoder(freeze_attention=freeze_attention)),
        lambda: with_replacement_loader(x, y, batch_size, batch_size * accumulate * steps, seed=0),
        callback, accumulate_grad_batches=accumulate,
    )
    return callback, caught


@pytest.fixture(scope="module")
def exact(digits, exact_gns):
    """Exact B_simple with the attention projections frozen (what per_example covers: 100%), and of the whole model."""
    return {frozen: exact_gns(SequenceFirstEncoder(freeze_attention=frozen), F.cross_entropy, *digits)[0]
            for frozen in (True, False)}


def test_per_example_measures_the_sequence_first_layers_along_dim_1(digits, exact):
    callback, _ = run(digits, batch_size=32)
    assert callback.coverage["fraction"] == 1.0
    assert callback.run_estimate.method == "per_example" and callback.run_estimate.steps == STEPS
    assert_matches_exact(callback.run_estimate, exact[True])


def test_batch_equal_to_the_sequence_length_is_refused_not_guessed(digits):
    callback, caught = run(digits, batch_size=8)  # T = 8 = B: dims 0 and 1 of (T, B, D) can't be told apart
    assert_withheld(callback.run_estimate, "both equal the batch size 8", "batch_first=True", "micro_batch")
    assert_withheld(callback.estimate)
    single(messages(caught, "stopped measuring"))  # warned once


def test_the_attention_projections_are_measured_along_dim_1_too(digits, exact):
    """``nn.MultiheadAttention`` applies its projections functionally; they are measured all the same
    (:mod:`gns_callback.per_example.attention`), so ``auto`` keeps ``per_example`` and covers the whole model."""
    callback, _ = run(digits, batch_size=16, accumulate=2, freeze_attention=False, method="auto")
    assert callback.run_estimate.method == "per_example" and callback.coverage["fraction"] == 1.0
    assert_matches_exact(callback.run_estimate, exact[False])
