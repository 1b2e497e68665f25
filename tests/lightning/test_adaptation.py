"""Adapter: a change during an unfinished LR ramp scales the LR the ramp was heading for."""

from types import SimpleNamespace

from gns_callback.lightning.adaptation import Adapter
from gns_callback.recommendation.adapt import AdaptDecision


def test_a_change_mid_ramp_scales_the_ramps_target_not_the_current_multiplier(monkeypatch):
    adapter = Adapter(factor=2.0, patience=1)
    adapter.lr_multiplier = 1.25  # one step into a ramp from 1.0 to 2.0
    adapter.ramp = {"start": 1.0, "target": 2.0, "step": 1, "warmup_steps": 4}
    decision = AdaptDecision(True, 4, 128, 2.0, "test")  # batch doubled: linear rule, LR ×2
    monkeypatch.setattr(adapter.policy, "decide", lambda *args, **kwargs: decision)
    trainer = SimpleNamespace(accumulate_grad_batches=2, world_size=1, current_epoch=0, global_step=10)
    adapter.consider(trainer, SimpleNamespace(lr_rule="linear", b_noise=100.0), 32, None, "per_example")
    assert adapter.ramp["start"] == 1.25
    assert adapter.ramp["target"] == 4.0
