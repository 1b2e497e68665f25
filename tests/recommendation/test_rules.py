import math

import pytest
import torch

from gns_callback.recommendation import lr_rule_for, optimizer_name, scale_lr, warmup_epochs_for, warmup_lambda, warmup_lr


def _params():
    return [torch.nn.Parameter(torch.zeros(2))]


@pytest.mark.parametrize("cls", [torch.optim.SGD, torch.optim.ASGD])
def test_sgd_family_linear_by_class_instance_and_name(cls):
    assert lr_rule_for(cls) == ("linear", None)
    assert lr_rule_for(cls(_params(), lr=0.1)) == ("linear", None)
    assert lr_rule_for(cls.__name__) == ("linear", None)
    assert lr_rule_for(f"torch.optim.{cls.__name__}") == ("linear", None)


def test_sgd_with_momentum_and_nesterov_is_linear():
    opt = torch.optim.SGD(_params(), lr=0.1, momentum=0.9, nesterov=True)
    assert lr_rule_for(opt)[0] == "linear"
    for name in ("LARS", "LARC", "SGDW", "FusedSGD", "nesterov", "momentum"):
        assert lr_rule_for(name)[0] == "linear", name


@pytest.mark.parametrize(
    "cls", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax,
            torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta]
)
def test_adaptive_family_sqrt_by_class_instance_and_name(cls):
    assert lr_rule_for(cls) == ("sqrt", None)
    assert lr_rule_for(cls(_params(), lr=1e-3)) == ("sqrt", None)
    assert lr_rule_for(cls.__name__.lower()) == ("sqrt", None)


@pytest.mark.parametrize("name", ["LAMB", "Lamb", "Adafactor", "AdamW8bit", "FusedAdam", "DeepSpeedCPUAdam", "NovoGrad"])
def test_other_adaptive_names_sqrt(name):
    assert lr_rule_for(name) == ("sqrt", None)


def test_subclass_inherits_family_through_mro():
    class MyOptimizer(torch.optim.SGD):
        pass

    assert optimizer_name(MyOptimizer) == "MyOptimizer"
    assert lr_rule_for(MyOptimizer)[0] == "linear"
    assert lr_rule_for(MyOptimizer(_params(), lr=0.1))[0] == "linear"


def test_lightning_optimizer_wrapper_is_unwrapped():
    from pytorch_lightning.core.optimizer import LightningOptimizer

    wrapped = LightningOptimizer(torch.optim.AdamW(_params(), lr=1e-3))
    assert optimizer_name(wrapped) == "AdamW"
    assert lr_rule_for(wrapped)[0] == "sqrt"


def test_unknown_optimizer_defaults_to_sqrt_with_a_note_and_lbfgs_none():
    rule, note = lr_rule_for("Lion")
    assert rule == "sqrt" and "Lion" in note and "lr_rule" in note
    assert lr_rule_for(None)[0] == "sqrt"
    assert lr_rule_for(torch.optim.LBFGS)[0] == "none"


def test_scale_lr():
    assert scale_lr(0.1, 256, 1024, "linear") == pytest.approx(0.4)
    assert scale_lr(1e-3, 64, 256, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(1e-3, 256, 64, "sqrt") == pytest.approx(5e-4)
    assert scale_lr(0.3, 64, 8192, "none") == 0.3
    with pytest.raises(ValueError):
        scale_lr(0.1, 64, 128, "cubic")


def test_warmup_thresholds():
    # No warmup up to 2x (and never for a decrease); Goyal's 5 epochs from a 32x LR jump on, log-proportional below.
    assert warmup_epochs_for(0.25) == 0.0
    assert warmup_epochs_for(1.0) == 0.0
    assert warmup_epochs_for(2.0) == 0.0
    assert warmup_epochs_for(2.01) > 0.0
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
    assert optimizer_name(Wrapper(inner)) == "SGD" and lr_rule_for(Wrapper(inner))[0] == "linear"

    class NotAWrapper:
        optimizer = "adam"  # not a torch optimizer: not followed

    assert optimizer_name(NotAWrapper()) == "NotAWrapper"
