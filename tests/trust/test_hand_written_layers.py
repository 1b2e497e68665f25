"""Layers written out with bare parameters (``x @ W + b``, ``F.linear(x, W, b)``), as research code does, in a real
fit (:mod:`gns_callback.per_example.matmul`). Before, a model made only of them was refused at fit start ("no
parameter is in a supported layer") with one micro-batch per step, and one with some ``nn.Linear`` layers beside
them was measured on those alone (``partial_coverage``): benchmarks/RESULTS.md, "Weights applied as matrix
products"."""

import pytest

from gns_callback import GradientNoiseScaleCallback
from tests.helpers import Classifier, with_replacement_loader
from tests.trust.models import EinsumOnly
from tests.trust.models import seeded_hand_written as hand_written
from tests.trust.setups import (assert_fit_measures_whole, assert_withheld, float32_and_bf16, messages,
                                scaled_and_unscaled, with_and_without)


def test_one_micro_batch_per_step_measures_hand_written_layers_whole(digits, exact_gns, tmp_path):
    x, y = digits
    assert_fit_measures_whole(hand_written, x, y, exact_gns, tmp_path)


def test_bf16_autocast_reads_what_float32_reads(digits, tmp_path):
    """Under bf16 autocast each weight is cast before its product; read through the cast, the estimate matches
    float32's on the same batches to bf16's rounding."""
    x, y = digits
    float32, bf16 = float32_and_bf16(hand_written, x, y, tmp_path)
    assert bf16.b_simple == pytest.approx(float32.b_simple, rel=0.05)


def test_a_gradient_scaler_s_scale_is_taken_out(digits):
    x, y = digits
    (unscaled, _), (scaled, coverage) = scaled_and_unscaled(hand_written, x, y, steps=30)
    assert coverage == 1.0
    assert scaled.b_simple == pytest.approx(unscaled.b_simple, rel=1e-4)


def test_weights_no_product_reads_are_not_measured_and_the_run_goes_on(digits, tmp_path):
    """Every weight applied by ``einsum``: fit start lets it through (whether a bare weight can be read shows only at
    the first step); the first step leaves both out, so measuring stops with the reason and the fix, once, and the
    run is the run without the callback."""
    x, y = digits
    callback = GradientNoiseScaleCallback(report_path=str(tmp_path / "report.json"), verbose=False)
    _, caught = with_and_without(lambda: Classifier(EinsumOnly()),
                                 lambda: with_replacement_loader(x, y, 32, 32 * 10), callback)
    assert_withheld(callback.run_estimate, "every trainable parameter is left out", "method='micro_batch'")
    assert len(messages(caught, "stopped measuring")) == 1
