import math

import pytest
import torch

from gns_callback.recommendation import lr_rule_for, optimizer_name, scale_lr, warmup_epochs_for, warmup_lambda, warmup_lr
from gns_callback.recommendation.rules import lr_factor


def _params():
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.ASGD])
def test_sgd_family_noise_linear_by_class_instance_and_name(cls):
    assert lr_rule_for(cls) == ("noise_linear", None)
    assert lr_rule_for(cls(_params(), lr=0.1)) == ("noise_linear", None)
    assert lr_rule_for(cls.__name__) == ("noise_linear", None)
    assert lr_rule_for(f"torch.optim.{cls.__name__}") == ("noise_linear", None)


def test_sgd_with_momentum_and_nesterov_is_noise_linear():
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9, nesterov=True)
    assert lr_rule_for(opt)[0] == "noise_linear"
    for name in ("LARS", "LARC", "SGDW", "FusedSGD", "nesterov", "momentum"):
        assert lr_rule_for(name)[0] == "noise_linear", name


@pytest.mark.parametrize(
    "cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
            torch.optim.Adadelta]
)
def test_adaptive_family_noise_sqrt_by_class_instance_and_name(cls):
    assert lr_rule_for(cls) == ("noise_sqrt", None)
    assert lr_rule_for(cls(_params(), lr=1e-3)) == ("noise_sqrt", None)
    assert lr_rule_for(cls.__name__.lower()) == ("noise_sqrt", None)


@pytest.mark.parametrize("cls", [torch.optim.RMSprop, torch.optim.Adagrad])
def test_adaptive_without_a_first_moment_noise_inverse_sqrt(cls):
    """RMSprop (at its default momentum 0) and Adagrad step lr·g/√v: the LR falls as the batch rises."""
    assert lr_rule_for(cls) == ("noise_inverse_sqrt", None)
    assert lr_rule_for(cls(_params(), lr=1e-3)) == ("noise_inverse_sqrt", None)
    assert lr_rule_for(cls.__name__.lower()) == ("noise_inverse_sqrt", None)


def test_the_instance_first_moment_decides():
    assert lr_rule_for(torch.optim.RMSprop(_params(), lr=1e-3, momentum=0.9))[0] == "noise_sqrt"
    assert lr_rule_for(torch.optim.Adam(_params(), lr=1e-3, betas=(0.0, 0.999)))[0] == "noise_inverse_sqrt"
    assert lr_rule_for(torch.optim.AdamW(_params(), lr=1e-3, weight_decay=0.1))[0] == "noise_sqrt"


def test_noise_inverse_sqrt_lowers_the_lr_on_an_increase():
    # Digits MLP, RMSprop tuned at batch 8 (LR 0.0134), B_noise read 34.1, moved to 32: ×√((1 + 34.1/32)/(1 + 34.1/8))
    # = ×0.627 → 0.0084 (0 of 8 fresh seeds diverged; the kept LR 5 of 8, noise_sqrt's 0.0214 8 of 8).
    assert scale_lr(0.0134, 8, 32, "noise_inverse_sqrt", 34.1) == pytest.approx(0.0134 * 0.6265, rel=1e-3)
    assert lr_factor(8, 32, "inverse_sqrt") == pytest.approx(0.5)
    assert lr_factor(8, 32, "noise_inverse_sqrt", math.inf) == pytest.approx(0.5)
    assert lr_factor(8, 32, "noise_inverse_sqrt", 0.0) == 1.0


@pytest.mark.parametrize("name", ["LAMB", "Lamb", "Adafactor", "AdamW8bit", "FusedAdam", "DeepSpeedCPUAdam", "NovoGrad"])
def test_other_adaptive_names_noise_sqrt(name):
    assert lr_rule_for(name) == ("noise_sqrt", None)


def test_subclass_inherits_family_through_mro():
    class MyOptimizer(torch.optim.SGD):
        pass

    assert optimizer_name(MyOptimizer) == "MyOptimizer"
    assert lr_rule_for(MyOptimizer)[0] == "noise_linear"
    assert lr_rule_for(MyOptimizer(_params(), lr=0.1))[0] == "noise_linear"


def test_lightning_optimizer_wrapper_is_unwrapped():
    from pytorch_lightning.core.optimizer import LightningOptimizer

    wrapped = LightningOptimizer(torch.optim.AdamW(_params(), lr=1e-3))
    assert optimizer_name(wrapped) == "AdamW"
    assert lr_rule_for(wrapped)[0] == "noise_sqrt"


def test_unknown_optimizer_defaults_to_noise_sqrt_with_a_note_and_lbfgs_none():
    rule, note = lr_rule_for("Lion")
    assert rule == "noise_sqrt" and "Lion" in note and "lr_rule" in note
    assert lr_rule_for(None)[0] == "noise_sqrt"
    assert lr_rule_for(torch.optim.LBFGS)[0] == "none"


def test_scale_lr():
    assert scale_lr(0.1, 256, 1024, "linear") == pytest.approx(0.4)
    assert scale_lr(1e-3, 64, 256, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(1e-3, 256, 64, "sqrt") == pytest.approx(5e-4)
    assert scale_lr(0.3, 64, 8192, "none") == 0.3
    with pytest.raises(ValueError):
        scale_lr(0.1, 64, 128, "cubic")


def test_warmup_thresholds():
    # Warmup for any increase (never for a decrease); Goyal's 5 epochs from a 32x LR jump on, log-proportional below.
    assert warmup_epochs_for(0.25) == 0.0
    assert warmup_epochs_for(1.0) == 0.0
    assert warmup_epochs_for(1.01) == pytest.approx(math.log2(1.01))
    assert warmup_epochs_for(2.0) == pytest.approx(1.0)
    assert warmup_epochs_for(2.0, threshold=2.0) == 0.0 and warmup_epochs_for(2.01, threshold=2.0) > 0.0
    assert warmup_epochs_for(4.0) == pytest.approx(2.0)
    assert warmup_epochs_for(8.0) == pytest.approx(3.0)
    assert warmup_epochs_for(16.0) == pytest.approx(4.0)
    assert warmup_epochs_for(32.0) == pytest.approx(5.0)
    assert warmup_epochs_for(1000.0) == pytest.approx(5.0)
    assert warmup_epochs_for(4.0, threshold=4.0) == 0.0
    assert warmup_epochs_for(8.0, warmup_epochs=10.0) == pytest.approx(6.0)
    assert warmup_epochs_for(math.inf) == 0.0


def test_warmup_lr_ramp_matches_torch_linear_lr():
    start, target, n = 0.1, 0.8, 10
    opt = torch.optim.SGD(_params(), lr=target)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=start / target, total_iters=n)
    for step in range(15):
        assert opt.param_groups[0]["lr"] == pytest.approx(warmup_lr(step, start_lr=start, target_lr=target, warmup_steps=n))
        opt.step()
        sched.step()
    assert warmup_lr(0, start_lr=start, target_lr=target, warmup_steps=0) == target
    factor = warmup_lambda(0.25, 4)
    assert [factor(s) for s in (0, 2, 4, 100)] == pytest.approx([0.25, 0.625, 1.0, 1.0])


def test_any_wrapper_exposing_optimizer_is_unwrapped_generically():
    class Wrapper:  # no framework class name involved: only an ``.optimizer`` that is a torch optimizer
        def __init__(self, inner):
            self.optimizer = inner

    inner = torch.optim.SGD(_params(), lr=0.1)
    assert optimizer_name(Wrapper(inner)) == "SGD" and lr_rule_for(Wrapper(inner))[0] == "noise_linear"

    class NotAWrapper:
        optimizer = "adam"  # not a torch optimizer: not followed

    assert optimizer_name(NotAWrapper()) == "NotAWrapper"


# --- the noise-aware transfer: ε(B) = ε_max/(1 + B_noise/B)^p, p = 1 (SGD) or ½ (Adam) -------------------------
def _closed_form(b0, b1, b_noise, p):
    return ((1 + b_noise / b0) / (1 + b_noise / b1)) ** p


@pytest.mark.parametrize("rule, p", [("noise_linear", 1.0), ("noise_sqrt", 0.5), ("noise_inverse_sqrt", -0.5)])
@pytest.mark.parametrize("b0, b1, b_noise", [(8, 32, 40.0), (512, 16, 16.0), (64, 4096, 100.0), (100, 100, 7.0)])
def test_noise_rules_closed_form_in_both_directions(rule, p, b0, b1, b_noise):
    up = lr_factor(b0, b1, rule, b_noise)
    assert up == pytest.approx(_closed_form(b0, b1, b_noise, p), rel=1e-12)
    # Back and forth is the identity: the transfer is a ratio of one curve ε(B)/ε_max.
    assert up * lr_factor(b1, b0, rule, b_noise) == pytest.approx(1.0, rel=1e-12)


def test_the_issue_cases():
    # SGD batch 8, lr 0.531 → 32 at B_noise 40: ×(1 + 5)/(1 + 1.25) = 2.667 (linear: ×4 → 2.12, which diverged).
    assert scale_lr(0.531, 8, 32, "noise_linear", 40.0) == pytest.approx(0.531 * 6 / 2.25)
    assert scale_lr(0.531, 8, 32, "linear") == pytest.approx(2.124)
    # SGD batch 512, lr 1.5 → 16 at B_noise 16: ×(1 + 1/32)/2 ≈ 0.516 (linear: ×1/32 → 0.047).
    assert scale_lr(1.5, 512, 16, "noise_linear", 16.0) == pytest.approx(1.5 * (1 + 16 / 512) / 2)
    assert scale_lr(1.5, 512, 16, "linear") == pytest.approx(0.046875)
    # Adam batch 8, lr 0.011 → 64 at B_noise 40: ×√(6/1.625) ≈ 1.92 (sqrt: ×√8 ≈ 2.83).
    assert scale_lr(0.011, 8, 64, "noise_sqrt", 40.0) == pytest.approx(0.011 * math.sqrt(6 / 1.625))


@pytest.mark.parametrize("rule, limit, p", [("noise_linear", "linear", 1.0), ("noise_sqrt", "sqrt", 0.5)])
def test_small_batch_limit_and_saturation(rule, limit, p):
    # B ≪ B_noise: the plain rule, to first order in B/B_noise (relative error ≤ B1/B_noise).
    for b_noise in (1e4, 1e6, 1e8):
        got, plain = lr_factor(8, 32, rule, b_noise), lr_factor(8, 32, limit)
        assert plain == pytest.approx(4.0**p)
        assert abs(got / plain - 1) <= p * 32 / b_noise
    assert lr_factor(8, 32, rule, math.inf) == lr_factor(8, 32, limit)
    # B ≫ B_noise: flat; a batch 1000× the noise scale and another 10× further move the LR by < 0.1%.
    assert lr_factor(10_000, 100_000, rule, 10.0) == pytest.approx(1.0, abs=1e-3)
    # In between, always between flat and the plain rule, and monotone in B_noise.
    factors = [lr_factor(64, 256, rule, b) for b in (1.0, 10.0, 64.0, 256.0, 1e3, 1e5)]
    assert all(1.0 < f < 4.0**p for f in factors) and factors == sorted(factors)
    # The same for a decrease: between 1 and the plain rule's 1/κ^p.
    assert 0.25**p < lr_factor(256, 64, rule, 64.0) < 1.0
    # No noise at all: the LR does not move.
    assert lr_factor(8, 32, rule, 0.0) == 1.0


def test_noise_rules_need_a_usable_b_noise():
    for bad in (None, math.nan, -1.0):
        with pytest.raises(ValueError, match="b_noise"):
            lr_factor(8, 32, "noise_linear", bad)
    assert lr_factor(8, 32, "linear", None) == 4.0  # the plain rules ignore it
    with pytest.raises(ValueError, match="batch sizes"):
        lr_factor(0, 32, "linear")
    with pytest.raises(ValueError, match="lr_rule"):
        lr_factor(8, 32, "cubic")
