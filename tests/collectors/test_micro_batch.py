"""Parameter hooks see each backward pass's own gradient, not the accumulated .grad."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleMeter
from gns_callback.accumulation import AccumulationWindow
from gns_callback.collectors.micro_batch import MicroBatchCollector
from tests.helpers import mlp


def test_hook_norms_equal_each_micro_batch_gradient():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    collector = MicroBatchCollector(net)
    collector.attach()
    for _ in range(3):  # accumulate three backward passes into .grad
        x = torch.randn(6, 5)
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]
        net(x).pow(2).mean().backward()
        own = sum((p.grad - g0).pow(2).sum() for p, g0 in zip(net.parameters(), before))
        (got,) = collector.pop()
        assert got.item() == pytest.approx(own.item(), rel=1e-5)
    assert collector.pop() == []
    collector.detach()
    net(torch.randn(2, 5)).sum().backward()
    assert collector.pop() == [] and not collector.attached


def test_frozen_and_unused_parameters_are_skipped():
    net = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 1), "unused": torch.nn.Linear(3, 1)})
    net["used"].bias.requires_grad_(False)
    collector = MicroBatchCollector(net)
    collector.attach()
    net["used"](torch.randn(4, 3)).sum().backward()
    (got,) = collector.pop()
    assert got.item() == pytest.approx(net["used"].weight.grad.pow(2).sum().item())


def test_autograd_grad_passes_are_not_measured():
    """A gradient penalty's ``torch.autograd.grad`` pass never reaches ``.grad``: only the real backward counts."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    collector = MicroBatchCollector(net)
    collector.attach()
    x = torch.randn(4, 3, requires_grad=True)
    out = net(x).pow(2).sum()
    (gx,) = torch.autograd.grad(out, x, create_graph=True)
    (out + gx.pow(2).sum()).backward()
    (got,) = collector.pop()
    assert got.item() == pytest.approx(sum(p.grad.pow(2).sum() for p in net.parameters()).item(), rel=1e-5)


def test_pop_into_scales_each_pass_by_the_loss_divisor():
    """Each pass's loss was divided by 2: the unit is the micro-batch mean gradient ``2·ĝ``, weighted by its size."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1, bias=False)
    collector = MicroBatchCollector(net)
    collector.attach()
    xs = [torch.randn(5, 3), torch.randn(5, 3)]
    for x in xs:
        (net(x).mean() / 2).backward()
    window = AccumulationWindow()
    assert collector.pop_into(window, batch_sizes=[5], loss_divisor=2, loss_reduction="mean") == 2
    expected = sum(5 * x.mean(0).pow(2).sum() for x in xs)
    assert window.packed()[0].item() == pytest.approx(expected.item(), rel=1e-5)
    with pytest.raises(RuntimeError, match="micro_batch_size"):
        (net(xs[0]).mean()).backward()
        collector.pop_into(AccumulationWindow(), batch_sizes=None, loss_divisor=1, loss_reduction="mean")


@pytest.mark.parametrize("bucket_bytes", [2**25, 64])
@pytest.mark.parametrize("zeroed", [False, True])
def test_held_gradients_are_squared_in_buckets_and_adopted_ones_at_once(monkeypatch, bucket_bytes, zeroed):
    """A pass into an empty ``.grad`` squares each gradient at once (autograd adopts the tensor); later passes, and
    every pass into zeroed ``.grad``, hold their gradients and square them in buckets (a tiny bucket forces
    several per pass); nothing stays held after a pass, and each pass's value is its own gradient's."""
    import gns_callback.collectors.micro_batch as micro_batch

    monkeypatch.setattr(micro_batch, "BUCKET_BYTES", bucket_bytes)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    if zeroed:  # zero_grad(set_to_none=False): every pass accumulates into an existing .grad
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
    collector = MicroBatchCollector(net)
    collector.attach()
    for _ in range(3):
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in net.parameters()]
        net(torch.randn(6, 5)).pow(2).mean().backward()
        assert not collector._held
        own = sum((p.grad - g0).pow(2).sum() for p, g0 in zip(net.parameters(), before))
        (got,) = collector.pop()
        assert got.item() == pytest.approx(own.item(), rel=1e-5)


def test_a_plain_loop_that_gives_no_size_is_told_to_give_it_with_the_size_seen():
    """``meter.step()`` without ``micro_batch_size`` in a loop of 2 passes of 16: before, the reason blamed the
    batch ("it could not be read off the batch: the batch holds no tensor ... let the DataLoader yield tensors"),
    with the plain loop's fix in a closing parenthesis; now it names ``micro_batch_size`` and the size each forward
    pass took."""
    net, g = mlp(), torch.Generator().manual_seed(0)
    x, y = torch.rand(64, 64), torch.randint(0, 10, (64,))
    with warnings.catch_warnings(record=True), GradientNoiseScaleMeter(net, method="micro_batch") as meter:
        warnings.simplefilter("always")
        for _ in range(3):
            for _ in range(2):
                i = torch.randint(0, 64, (16,), generator=g)
                (F.cross_entropy(net(x[i]), y[i]) / 2).backward()
            meter.step()
            net.zero_grad()
    failure = meter.run_estimate.failure
    assert "meter.step() was given none" in failure and "meter.step(micro_batch_size=16)" in failure
