"""``PassLedger`` (gns_callback/backward_passes.py): which backward passes are kept, and which are one pass."""

import operator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from gns_callback.backward_passes import PassLedger, hooks_inert, measurement_paused


class Recorder:
    """Records, per pass id, which layers' output gradients arrived (the ledger's value: a list of names)."""

    def __init__(self, model: nn.Sequential) -> None:
        self.ledger: PassLedger[list[str]] = PassLedger(new=list, merge=operator.add)
        self.ledger.watch(model.parameters())
        for name, layer in model.named_children():
            layer.register_forward_hook(lambda module, args, out, name=name: self._on_forward(name, out))

    def _on_forward(self, name: str, out: torch.Tensor) -> None:
        if out.requires_grad:
            out.register_hook(lambda grad: self._arrived(name))

    def _arrived(self, name: str) -> None:
        self.ledger.record(self.ledger.current()).append(name)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))


def test_each_backward_call_is_a_pass_and_autograd_grad_is_dropped():
    net = model()
    recorder = Recorder(net)
    x = torch.randn(3, 4)
    net(x).sum().backward()
    torch.autograd.grad(net(x).sum(), list(net.parameters()))  # fills no .grad: not committed
    net(x).sum().backward()
    passes = recorder.ledger.pop()
    assert len(passes) == 2 and all(sorted(p) == ["0", "1", "2", "3", "4"] for p in passes)


def reentrant_forward(net: nn.Sequential, segments: list[tuple[int, int]]):
    def forward(x):
        position = 0
        for start, stop in segments:
            x = checkpoint(net[start:stop], net[position:start](x), use_reentrant=True)
            position = stop
        return net[position:](x)
    return forward


def test_a_reentrant_segment_is_part_of_the_pass_that_runs_it_in_either_order():
    """"middle": the outer pass reaches the head before the segment; "last": the segment runs first and the outer
    pass is seen only after it; "each": two segments before the outer pass is seen."""
    for segments in ([(1, 4)], [(1, 5)], [(1, 3), (3, 5)]):
        net = model()
        recorder = Recorder(net)
        forward = reentrant_forward(net, segments)
        for _ in range(2):  # two micro-batches: two passes, each whole
            forward(torch.randn(3, 4)).sum().backward()
        passes = recorder.ledger.pop()
        assert [sorted(p) for p in passes] == [["0", "1", "2", "3", "4"]] * 2, (segments, passes)


def test_a_pass_inside_another_that_fills_no_grad_is_dropped():
    """``torch.autograd.grad`` through the model from a hook during backward (a saliency, say): a pass inside the
    outer one, like a reentrant segment, but it accumulates into no ``.grad``, so it is no part of the step."""
    net = model()
    recorder = Recorder(net)
    probe = torch.randn(3, 4, requires_grad=True)
    hidden = net[0](torch.randn(3, 4))

    def saliency(grad):
        with torch.enable_grad():  # backward runs hooks with grad mode off
            torch.autograd.grad(net(probe).sum(), probe)

    hidden.register_hook(saliency)
    net[1:](hidden).sum().backward()
    (only,) = recorder.ledger.pop()
    assert sorted(only) == ["0", "1", "2", "3", "4"]


def test_measurement_pauses_nest_and_end_with_their_context():
    assert not hooks_inert()
    with measurement_paused():
        with measurement_paused():
            assert hooks_inert()
        assert hooks_inert()
    assert not hooks_inert()
    try:
        with measurement_paused():
            raise RuntimeError("a probe step failed")
    except RuntimeError:
        pass
    assert not hooks_inert()
