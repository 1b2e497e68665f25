import math

import pytest
import torch

from gns_callback.recommendation.learning_rate import (INCREASE_MARGIN, choose_lr, param_groups_note, peak_schedule_note,
                                                    pick_rule, plan_warmup, sgd_ceiling, transfer)
from gns_callback.recommendation import recommend


def test_pick_rule_by_family_override_and_unknown():
    assert pick_rule(torch.optim.SGD, None)[:2] == ("noise_linear", "SGD family: SGD")
    rule, source, notes = pick_rule("AdamW", None)
    assert (rule, source) == ("noise_sqrt", "adaptive (Adam) family: AdamW") and "Malladi" in notes[0]
    assert pick_rule("AdamW", "linear") == ("linear", "user override", ())
    rule, source, notes = pick_rule("Lion", None)
    assert source == "unknown optimizer: default" and "Lion" in notes[0]
    with pytest.raises(ValueError, match="lr_rule"):
        pick_rule("SGD", "cubic")


def test_choose_lr_scales_and_cites():
    lr = choose_lr(0.1, 256, 64, torch.optim.SGD, None, b_noise=64.0)  # a decrease: the rule as is
    assert lr.learning_rate == pytest.approx(0.1 * 1.25 / 2) and "McCandlish" in lr.citation
    assert "small-batch limit" in lr.citation and "Goyal" in lr.citation
    assert "×0.625 = noise_linear" in lr.notes[0] and "would give ×0.25" in lr.notes[0]
    assert choose_lr(0.1, 64, 256, torch.optim.SGD, "linear", b_noise=64.0).learning_rate == pytest.approx(0.4)
    assert choose_lr(None, 64, 256, "SGD", None, b_noise=64.0).learning_rate is None
    assert choose_lr(1e-3, 64, 256, "SGD", "sqrt", b_noise=64.0).citation.startswith("user override (Malladi")


def test_sgd_increase_needs_the_curvature_unless_the_rule_is_explicit():
    held = choose_lr(0.1, 64, 256, torch.optim.SGD, None, b_noise=64.0)
    assert held.learning_rate == 0.1 and held.ceiling.lr == 0.1 and "not raised" in held.notes[-1]
    explicit = choose_lr(0.1, 64, 256, torch.optim.SGD, "noise_linear", b_noise=64.0)
    assert explicit.learning_rate == pytest.approx(0.1 * 2 / 1.25) and explicit.ceiling.lr is None
    capped = choose_lr(0.1, 64, 256, torch.optim.SGD, None, b_noise=64.0, sharpness=16.0)  # limit 2/16
    assert capped.learning_rate == pytest.approx(0.125) and "capped" in capped.notes[-1]
    free = choose_lr(0.1, 64, 256, torch.optim.SGD, None, b_noise=64.0, sharpness=1.0)  # limit 2
    assert free.learning_rate == pytest.approx(0.16 * INCREASE_MARGIN)
    assert free.ceiling.stability_limit == pytest.approx(2.0) and any("below the rule" in n for n in free.notes)
    adam = choose_lr(1e-3, 64, 256, "Adam", None, b_noise=64.0)
    assert adam.learning_rate == pytest.approx(1e-3 * (2 / 1.25) ** 0.5) and adam.ceiling.lr is None


def test_transfer_without_a_usable_noise_scale_falls_back_to_the_limit_with_a_note():
    lr, notes = transfer(0.1, 64, 256, "noise_linear", float("nan"))
    assert lr == pytest.approx(0.4) and "small-batch limit" in notes[0]
    assert transfer(0.1, 64, 64, "noise_sqrt", float("nan")) == (0.1, ())
    assert transfer(0.1, 64, 256, "noise_linear", float("inf"))[0] == pytest.approx(0.4)


def test_sgd_ceiling_for_sgd_only():
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5, momentum=0.9)
    ceiling, notes = sgd_ceiling(0.5, "noise_linear", 2.0, sgd, automatic=True)
    assert ceiling.stability_limit == pytest.approx(1.9) and ceiling.lr == pytest.approx(1.9) and notes == ()
    ceiling, notes = sgd_ceiling(0.5, "linear", 2.0, "SGD", automatic=False)  # momentum unknown: 2/λ
    assert ceiling.lr == pytest.approx(1.0) and "momentum unknown" in notes[0]
    assert sgd_ceiling(1.5, "noise_linear", 2.0, "SGD", automatic=True)[0].lr == 1.5  # never below the current
    assert sgd_ceiling(0.5, "noise_linear", None, "SGD", automatic=True)[0].lr == 0.5
    assert sgd_ceiling(0.5, "noise_linear", None, "SGD", automatic=False)[0].lr is None
    ceiling, notes = sgd_ceiling(1e-3, "noise_sqrt", 2.0, "Adam", automatic=True)
    assert ceiling.lr is None and "not used" in notes[0]


def test_warmup_in_steps_epochs_only_or_none():
    w = plan_warmup(0.1, 0.8, 256, 10_000.0, threshold=2.0, warmup_epochs=5.0)
    assert w.epochs == pytest.approx(3.0) and w.steps == math.ceil(3 * 10_000 / 256)
    assert w.start_factor == pytest.approx(0.125)
    w = plan_warmup(0.1, 0.8, 256, None, threshold=2.0, warmup_epochs=5.0)
    assert w.steps is None and "dataset_size" in w.notes[0]
    assert plan_warmup(0.1, 0.2, 256, 1e4, threshold=2.0, warmup_epochs=5.0).steps == 0
    assert plan_warmup(0.8, 0.1, 256, 1e4, threshold=2.0, warmup_epochs=5.0).steps == 0
    assert plan_warmup(None, None, 256, 1e4, threshold=2.0, warmup_epochs=5.0).epochs == 0.0


def test_sgd_rule_uses_the_early_noise_scale_when_measured():
    # ε(B1) = ε(B0)·(1 + Be/B0)/(1 + Be/B1) at the early phase's Be = 8, not the batch target's 64.
    up = choose_lr(0.5, 8, 32, torch.optim.SGD, None, b_noise=64.0, early_b_noise=8.0)
    assert up.learning_rate == pytest.approx(0.5 * 2.0 / 1.25 * INCREASE_MARGIN) and up.ceiling.lr is None
    assert "early phase" in up.notes[0]
    # A decrease takes the larger (more cautious) of the two scales.
    down = choose_lr(1.0, 512, 64, torch.optim.SGD, None, b_noise=64.0, early_b_noise=8.0)
    assert down.learning_rate == pytest.approx((1 + 64 / 512) / (1 + 64 / 64))
    down = choose_lr(1.0, 512, 64, torch.optim.SGD, None, b_noise=4.0, early_b_noise=8.0)
    assert down.learning_rate == pytest.approx((1 + 8 / 512) / (1 + 8 / 64)) and "early phase" in down.notes[0]
    # Saturation: far above Be the LR hardly moves; far below, linear.
    assert choose_lr(1.0, 1024, 4096, "SGD", None, b_noise=64.0, early_b_noise=8.0).learning_rate < 1.01
    linear = choose_lr(1.0, 1, 2, "SGD", None, b_noise=1e6, early_b_noise=1e6).learning_rate
    assert linear == pytest.approx(2.0 * INCREASE_MARGIN, rel=1e-5)
    assert choose_lr(1.0, 8, 9, "SGD", None, b_noise=8.0, early_b_noise=8.0).learning_rate == 1.0  # margin ≥ rise
    # Adam keeps the batch's B_noise; an unusable early value is ignored.
    adam = choose_lr(1e-3, 64, 256, "Adam", None, b_noise=64.0, early_b_noise=8.0)
    assert adam.learning_rate == pytest.approx(1e-3 * (2 / 1.25) ** 0.5)
    for bad in (math.nan, 0.0, math.inf):
        held = choose_lr(0.1, 64, 256, torch.optim.SGD, None, b_noise=64.0, early_b_noise=bad)
        assert held.learning_rate == 0.1


def test_sgd_increase_uses_the_lower_end_of_the_early_noise_scale():
    # Batch 8 → 32 at the early phase's lower end 4 (point value 8): ε·(1 + 4/8)/(1 + 4/32), then the margin.
    up = choose_lr(0.5, 8, 32, torch.optim.SGD, None, b_noise=64.0, early_b_noise=8.0, early_b_noise_low=4.0)
    assert up.learning_rate == pytest.approx(0.5 * 1.5 / 1.125 * INCREASE_MARGIN)
    assert "lower end of its interval" in up.notes[0]
    # A lower end of 0 (the interval reaches 0): the rule gives no increase, the LR is kept.
    kept = choose_lr(0.5, 8, 32, torch.optim.SGD, None, b_noise=64.0, early_b_noise=8.0, early_b_noise_low=0.0)
    assert kept.learning_rate == 0.5
    # A decrease is not made smaller by it (the larger scale stays the cautious one); nan or a value above the
    # point value is ignored; the batch target still bounds an increase when it is the smaller.
    down = choose_lr(1.0, 512, 64, torch.optim.SGD, None, b_noise=4.0, early_b_noise=8.0, early_b_noise_low=2.0)
    assert down.learning_rate == pytest.approx((1 + 8 / 512) / (1 + 8 / 64))
    for ignored in (math.nan, 9.0):
        same = choose_lr(0.5, 8, 32, torch.optim.SGD, None, b_noise=64.0, early_b_noise=8.0, early_b_noise_low=ignored)
        assert same.learning_rate == pytest.approx(0.5 * 2.0 / 1.25 * INCREASE_MARGIN)
    batch = choose_lr(0.5, 8, 32, torch.optim.SGD, None, b_noise=2.0, early_b_noise=8.0, early_b_noise_low=4.0)
    assert batch.learning_rate == pytest.approx(max(0.5, 0.5 * 1.25 / (1 + 2 / 32) * INCREASE_MARGIN))
    # Adam's rule does not use the early phase at all.
    adam = choose_lr(1e-3, 64, 256, "Adam", None, b_noise=64.0, early_b_noise=8.0, early_b_noise_low=4.0)
    assert adam.learning_rate == pytest.approx(1e-3 * (2 / 1.25) ** 0.5)


def test_recommend_reads_the_lower_end_from_the_estimate():
    estimate = {"b_simple": 32.0, "ci_low": 28.0, "ci_high": 36.0, "steps": 500, "lr_noise_scale": 8.0,
                "lr_noise_scale_low": 4.0}
    rec = recommend(estimate, current_batch_size=8, current_lr=0.5, optimizer=torch.optim.SGD)
    assert rec.batch_size == 32
    assert rec.learning_rate == pytest.approx(0.5 * 1.5 / 1.125 * INCREASE_MARGIN)
    without = recommend({**estimate, "lr_noise_scale_low": None}, current_batch_size=8, current_lr=0.5,
                        optimizer=torch.optim.SGD)
    assert without.learning_rate == pytest.approx(0.5 * 2.0 / 1.25 * INCREASE_MARGIN)


def test_stability_limit_binds_only_below_it_with_the_early_noise_scale():
    capped = choose_lr(0.1, 8, 64, torch.optim.SGD, None, b_noise=64.0, early_b_noise=8.0, sharpness=14.0)
    assert capped.learning_rate == pytest.approx(1 / 7) and "capped" in capped.notes[-1]  # rule: 0.1·2/1.125·0.85
    above = choose_lr(0.5, 8, 64, torch.optim.SGD, None, b_noise=64.0, early_b_noise=8.0, sharpness=14.0)
    assert above.learning_rate == pytest.approx(0.5 * 2 / 1.125 * INCREASE_MARGIN) and above.ceiling.lr is None
    assert above.ceiling.stability_limit == pytest.approx(1 / 7) and any("not applied" in n for n in above.notes)


def test_a_peak_schedule_is_scaled_by_the_lr_factor_and_left_alone_at_one():
    note = peak_schedule_note("CyclicLR", [0.1, 0.02], 1.5)
    assert "×1.5" in note and "max_lr=0.15, 0.03" in note
    assert peak_schedule_note("OneCycleLR", [0.1], 1.0) is None
    assert peak_schedule_note("OneCycleLR", [0.1], math.nan) is None


def test_param_groups_at_different_lrs_are_each_scaled_by_the_factor():
    note = param_groups_note([0.0, 0.1, 0.02], 1.5)
    assert "3 param groups" in note and "×1.5" in note and "lr=0, 0.15, 0.03" in note
    assert param_groups_note([0.1, 0.1], 1.5) is None and param_groups_note([0.1], 2.0) is None
    assert param_groups_note([0.0, 0.1], math.nan) is None
