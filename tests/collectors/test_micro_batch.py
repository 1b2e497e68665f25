"""Parameter hooks see each backward pass's own gradient, not the accumulated .grad."""

import pytest
import torch

from gns_callback.collectors.micro_batch import MicroBatchGradNorms


def test_hook_norms_equal_each_micro_batch_gradient():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    collector = MicroBatchGradNorms()
    collector.attach(p for p in net.parameters())
    for _ in range(3):  # accumulate three backward passes into .grad
        x = torch.randn(6, 5)
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]
        net(x).pow(2).mean().backward()
        own = sum((p.grad - g0).pow(2).sum() for p, g0 in zip(net.parameters(), before))
        assert collector.pop().item() == pytest.approx(own.item(), rel=1e-5)
    assert collector.pop() is None
    collector.detach()
    net(torch.randn(2, 5)).sum().backward()
    assert collector.pop() is None and not collector.attached


def test_frozen_and_unused_parameters_are_skipped():
    net = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "unused": torch.nn.Linear(3, 1)})
    net["used"].bias.requires_grad_(False)
    collector = MicroBatchGradNorms()
    collector.attach(p for p in net.parameters() if p.requires_grad)
    net["used"](torch.randn(4, 3)).sum().backward()
    assert collector.pop().item() == pytest.approx(net["used"].weight.grad.pow(2).sum().item())
