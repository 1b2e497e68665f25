"""Layers written out with bare parameters (``x @ W + b``, ``F.linear(x, W, b)``), as research code does, in a real
fit (:mod:`gns_callback.per_example.matmul`). Before, a model made only of them was refused at fit start ("no
parameter is in a supported layer") with one micro-batch per step, and one with some ``nn.Linear`` layers beside
them was measured on those alone (``partial_coverage``): benchmarks/RESULTS.md, "Weights applied as matrix
products"."""

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gns_callback import GradientNoiseScaleCallback, GradientNoiseScaleMeter
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


class MergedAdapter(nn.Module):
    """A low-rank adapter merged into a frozen Linear's weight, ``W0 + 2·B @ A`` (``B`` 32×4, as many rows as the
    batch), then a trained head, its logits offset towards one class (a gradient common to the examples: B_simple
    near 3, where the intervals are narrow)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.base = nn.Linear(64, 32).requires_grad_(False)
        self.A, self.B = nn.Parameter(torch.randn(4, 64) * 0.1), nn.Parameter(torch.randn(32, 4) * 0.1)
        self.head = nn.Linear(32, 10)
        self.register_buffer("offset", torch.eye(10)[0] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(F.linear(x, self.base.weight + 2 * self.B @ self.A, self.base.bias))
        return self.head(hidden) + self.offset


def test_a_weight_merged_from_parameters_is_not_read_per_row_in_a_plain_loop(digits, exact_gns):
    """At batch 32 ``A``'s product has 32 rows, ``B``'s: a plain loop at its defaults read them as the examples, and
    B_simple = 14.8 (95% CI 14.6-15.1) at 82% coverage, against an exact 3.41 of the parameters it measured (3.50
    for the whole model), in 5 of 5 data orders. Now ``A`` and ``B`` are left out, said once, and the interval holds
    the exact value of the head it measures (3.29 [3.23, 3.35] against 3.31)."""
    x, y = digits
    model = MergedAdapter()
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(300):
                index = torch.randint(0, len(x), (32,), generator=generator)
                F.cross_entropy(model(x[index]), y[index]).backward()
                meter.step()
                model.zero_grad()
    assert {"A", "B"} <= set(meter.coverage["uncovered"]), meter.coverage
    assert any("left the bare parameter" in str(w.message) for w in caught)
    model.A.requires_grad_(False), model.B.requires_grad_(False)
    exact = exact_gns(model, F.cross_entropy, x, y)[0]
    estimate = meter.run_estimate
    assert estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact)


class NormalizedPrototypes(nn.Module):
    """One Linear on the examples and on a table of 32 prototypes (as many as the batch) normalised per row,
    ``project(F.normalize(self.prototypes, dim=-1))``, then a head, its logits offset towards one class."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.project, self.head = nn.Linear(64, 16), nn.Linear(32, 10)
        self.prototypes = nn.Parameter(torch.randn(32, 64) * 0.1)
        self.register_buffer("offset", torch.eye(10)[0] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = self.project(F.normalize(self.prototypes, dim=-1))
        return self.head(torch.tanh(self.project(x) @ table.T)) + self.offset


class LearnedQueries(nn.Module):
    """A Perceiver's learned latents expanded to the batch, ``project(latents.expand(B, L, D))``, 32 of them (as
    many as the batch): one copy per example, so their rows are the examples'."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.latents = nn.Parameter(torch.randn(32, 16) * 0.3)
        self.encode, self.project, self.head = nn.Linear(64, 16), nn.Linear(16, 16), nn.Linear(16, 10)
        self.register_buffer("offset", torch.eye(10)[0] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        queries = self.project(self.latents.expand(x.shape[0], -1, -1))  # (B, 32, 16)
        return self.head(torch.tanh((queries * self.encode(x).unsqueeze(1)).mean(1))) + self.offset


def _plain_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int = 300) -> tuple[Any, list]:
    """A meter at its defaults over ``steps`` batches of 32 drawn with replacement (lr 0: no optimizer)."""
    generator = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with GradientNoiseScaleMeter(model) as meter:
            for _ in range(steps):
                index = torch.randint(0, len(x), (32,), generator=generator)
                F.cross_entropy(model(x[index]), y[index]).backward()
                meter.step()
                model.zero_grad()
    return meter, caught


def test_a_layer_run_on_a_normalized_table_stops_measuring_in_a_plain_loop(digits):
    """``F.normalize`` expands each row's norm back over the row, an expand the walk of the layer's input stopped at:
    a plain loop at its defaults read the prototypes' rows as examples, B_simple = 13.67 (95% CI 13.32-14.04) against
    an exact 2.86 (whole, and of the parameters it measured), 0 of 3 data orders. Now refused at the first step."""
    x, y = digits
    meter, caught = _plain_loop(NormalizedPrototypes(), x, y, steps=3)
    assert_withheld(meter.run_estimate, "ran on a learned parameter (e.g. a table of prototypes)", "micro_batch")
    assert meter.run_estimate.steps == 0
    assert len(messages(caught, "stopped measuring")) == 1


def test_learned_queries_expanded_to_the_batch_are_measured_in_a_plain_loop(digits, exact_gns):
    """The batch expand still stops the walk: measured whole, 2.18 [2.14, 2.22] against an exact 2.19."""
    x, y = digits
    model = LearnedQueries()
    meter, _ = _plain_loop(model, x, y)
    for name in meter.coverage["uncovered"]:
        model.get_parameter(name).requires_grad_(False)
    exact = exact_gns(model, F.cross_entropy, x, y)[0]
    estimate = meter.run_estimate
    assert estimate.measured and estimate.ci_low <= exact <= estimate.ci_high, (estimate, exact, meter.coverage)
