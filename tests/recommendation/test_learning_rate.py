import math

import pytest
import torch

from gns_callback.recommendation.learning_rate import choose_lr, pick_rule, plan_warmup


def test_pick_rule_by_family_override_and_unknown():
    assert pick_rule(torch.optim.SGD, None)[:2] == ("linear", "SGD family: SGD")
    rule, source, notes = pick_rule("AdamW", None)
    assert (rule, source) == ("sqrt", "adaptive (Adam) family: AdamW") and "Malladi" in notes[0]
    assert pick_rule("AdamW", "linear") == ("linear", "user override", ())
    rule, source, notes = pick_rule("Lion", None)
    assert source == "unknown optimizer: default" and "Lion" in notes[0]
    with pytest.raises(ValueError, match="lr_rule"):
        pick_rule("SGD", "cubic")


def test_choose_lr_scales_and_cites():
    lr = choose_lr(0.1, 64, 256, torch.optim.SGD, None)
    assert lr.learning_rate == pytest.approx(0.4) and "Goyal" in lr.citation
    assert choose_lr(None, 64, 256, "SGD", None).learning_rate is None
    assert choose_lr(1e-3, 64, 256, "SGD", "sqrt").citation.startswith("user override (Malladi")


def test_warmup_in_steps_epochs_only_or_none():
    w = plan_warmup(0.1, 0.8, 256, 10_000.0, threshold=2.0, warmup_epochs=5.0)
    assert w.epochs == pytest.approx(3.0) and w.steps == math.ceil(3 * 10_000 / 256)
    assert w.start_factor == pytest.approx(0.125)
    w = plan_warmup(0.1, 0.8, 256, None, threshold=2.0, warmup_epochs=5.0)
    assert w.steps is None and "dataset_size" in w.notes[0]
    assert plan_warmup(0.1, 0.2, 256, 1e4, threshold=2.0, warmup_epochs=5.0).steps == 0
    assert plan_warmup(0.8, 0.1, 256, 1e4, threshold=2.0, warmup_epochs=5.0).steps == 0
    assert plan_warmup(None, None, 256, 1e4, threshold=2.0, warmup_epochs=5.0).epochs == 0.0
