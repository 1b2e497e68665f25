"""Module attributes a step changes come back: lists and dicts in place, counters, tensors changed in place or
replaced, torchmetrics states, added and deleted attributes; unchanged ones keep their identity; what cannot be
copied is named only if it changed."""

import threading

import torch
import torch.nn as nn
from torchmetrics.classification import MulticlassAccuracy

from gns_callback.probe.attributes import AttributeState, outside_modules


class Holder:
    def __init__(self):
        self.lock = threading.Lock()  # deepcopy refuses it
        self.count = 0


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.acc = MulticlassAccuracy(num_classes=3)
        self.outputs = [torch.ones(2)]
        self.stats = {"seen": 0, "names": ["a"]}
        self.count = 0
        self.total = torch.zeros(3)
        self.holder = Holder()
        self.static = ("config", 1)
        self.removed_later = [1, 2]

    def step(self, x, y):
        logits = self.layer(x)
        self.acc.update(logits, y)
        self.outputs.append(logits.detach())
        self.stats["seen"] += len(x)
        self.stats["names"].append("b")
        self.count += 1
        self.total += 1.0  # in place: same tensor object, new values
        self.holder.count += 1
        self.added = "new"
        self.__dict__.pop("removed_later", None)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def test_every_changed_attribute_comes_back_and_unchanged_ones_keep_their_identity():
    net = Net()
    net.acc.update(*reversed((torch.tensor([0, 1, 2, 2]), torch.eye(3)[[0, 1, 1, 2]])))  # some prior state
    before_acc = net.acc.compute().item()
    before_count = net.acc._update_count
    outputs, stats, total, static = net.outputs, net.stats, net.total, net.static
    state = AttributeState(net)
    for seed in range(3):  # restore may be called after every trial
        net.step(*batch(seed))
        state.restore()

        assert net.outputs is outputs and len(outputs) == 1 and torch.equal(outputs[0], torch.ones(2))
        assert net.stats is stats and stats == {"seen": 0, "names": ["a"]}
        assert net.count == 0
        assert net.total is total and torch.equal(total, torch.zeros(3))
        assert net.static is static
        assert net.removed_later == [1, 2] and not hasattr(net, "added")
        assert net.acc._update_count == before_count and net.acc.compute().item() == before_acc
    assert state.not_restored == {"holder"}  # its lock cannot be copied, and its count changed


def test_torchmetrics_epoch_value_is_unaffected():
    plain, probed = Net(), Net()
    probed.load_state_dict(plain.state_dict())
    x, y = batch(1)
    state = AttributeState(probed)
    probed.step(*batch(2))  # a probe step on other data
    probed.step(*batch(3))
    state.restore()
    plain.acc.update(plain.layer(x), y)
    probed.acc.update(probed.layer(x), y)
    assert plain.acc.compute() == probed.acc.compute()
    assert plain.acc._update_count == probed.acc._update_count == 1


def test_an_unchanged_uncopyable_attribute_is_not_reported():
    net = Net()
    state = AttributeState(net)
    net.count += 5
    state.restore()
    assert net.count == 0 and state.not_restored == set()


def test_large_attributes_are_not_copied_but_changes_to_them_are_reported():
    net = Net()
    net.data = torch.zeros(1000)  # 4000 bytes
    state = AttributeState(net, max_copy_bytes=1000)
    net.data[0] = 1.0
    state.restore()
    assert "data" in state.not_restored and "outputs" not in state.not_restored


def test_skipped_names_and_kept_objects_are_left_alone():
    net = Net()
    shared = {"owner": "trainer"}
    net.ref = shared
    net.internal = 1
    state = AttributeState(net, keep=[shared], skip=["internal"])
    net.internal = 2
    net.ref["owner"] = "changed"
    state.restore()
    assert net.internal == 2  # skipped
    assert net.ref is shared and shared == {"owner": "trainer"}  # restored in place, the object itself kept


def test_parameters_held_in_a_list_stay_the_parameters():
    """``nn.LSTM._flat_weights`` lists the parameters the fused kernel reads. A step that updates them in place
    (then put back by the parameter restore) must not make the list hold copies: the LSTM would compute with them
    and its parameters would get no gradient for the rest of the run."""
    lstm = nn.LSTM(3, 4)
    state = AttributeState(lstm)
    optimizer = torch.optim.SGD(lstm.parameters(), lr=0.1)
    lstm(torch.randn(5, 2, 3))[0].sum().backward()
    optimizer.step()
    state.restore()
    assert all(flat is getattr(lstm, name) for flat, name in zip(lstm._flat_weights, lstm._flat_weights_names))
    lstm.zero_grad()
    lstm(torch.randn(5, 2, 3))[0].sum().backward()
    assert all(p.grad is not None for p in lstm.parameters())


def test_outside_modules_are_found_through_plain_containers_but_not_in_the_tree_or_kept_objects():
    class Helper:  # a plain object holding a module, as an EMA helper class does
        def __init__(self, module):
            self.shadow = module

    net, teacher, ema, kept, deep = Net(), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)
    net.teacher = [teacher]
    net.helpers = {"ema": Helper(ema), "layer": [net.layer]}  # a module of the tree, held again: not outside
    net.kept = [kept]
    net.deep = [[[[[deep]]]]]  # deeper than the bounded walk goes
    found = outside_modules(net, keep=[kept])
    assert [(name, module) for name, module in found] == [("teacher[0]", teacher), ("helpers['ema'].shadow", ema)]
