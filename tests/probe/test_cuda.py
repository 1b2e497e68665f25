"""The probe's CUDA path: the allocator's peak as the measure, the device's free memory as the budget, a real
CUDA out-of-memory error survived, and everything (weights, optimizer state, BatchNorm statistics, CUDA RNG) put
back bit for bit. Skipped without CUDA (the suite never needs a GPU); benchmarks/RESULTS.md records where they ran.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gns_callback.probe import probe_micro_batch
from tests.probe.test_state import assert_same, clone

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on a GPU machine only)")

MiB = 2**20


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Dropout(0.3),
                         nn.Flatten(), nn.Linear(16 * 16 * 16, 10)).cuda()


def conv_batch(size: int = 8):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(size, 3, 16, 16, generator=gen).cuda(), torch.randint(0, 10, (size,), generator=gen).cuda()


def loss_of(net):
    return lambda batch: F.cross_entropy(net(batch[0]), batch[1])


def snapshot(net, optimizer):
    return {"model": clone(net.state_dict()), "optimizer": clone(optimizer.state_dict()),
            "cuda_rng": torch.cuda.get_rng_state(), "cpu_rng": torch.get_rng_state(), "training": net.training}


def trained(net, optimizer, batch, steps: int = 2):
    """A few real steps first: optimizer state and BatchNorm statistics exist, as in a run."""
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss_of(net)(batch).backward()
        optimizer.step()
    return net, optimizer


def test_cuda_probe_measures_the_allocator_peak_within_the_budget_and_restores_everything():
    net = bn_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batch = conv_batch()
    trained(net, optimizer, batch)
    before = snapshot(net, optimizer)
    budget = 256 * MiB
    result = probe_micro_batch(net, optimizer, batch, loss_of(net), memory_budget_bytes=budget, headroom=0.9,
                               throughput_sizes=(8, 32), timed_steps=2, timing_budget_s=0.0, progress_bar=False)
    assert result.measure == "cuda" and result.device.startswith("cuda")
    assert result.max_micro_batch > 32
    fitting = [t for t in result.trials if t.ok and t.measured_bytes is not None]
    assert fitting and all(t.measured_bytes <= 0.9 * budget for t in fitting)
    assert max(t.size for t in fitting) == result.max_micro_batch
    assert_same(before, snapshot(net, optimizer))


def test_default_budget_is_the_devices_free_memory():
    net = bn_net()
    result = probe_micro_batch(net, None, conv_batch(), loss_of(net), throughput=False, progress_bar=False,
                               max_batch_size=64)
    free, total = torch.cuda.mem_get_info()
    assert result.budget_bytes is not None and 0.5 * free <= result.budget_bytes <= total
    assert result.max_micro_batch == 64 and result.capped


class Wide(nn.Module):
    """About 16 MiB of activations per sample and almost no arithmetic: a real OOM is cheap to reach."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        return self.linear(x).relu().mean(dim=(1, 2))


def test_a_real_cuda_out_of_memory_is_survived_and_the_answer_fits():
    torch.manual_seed(0)
    net = Wide().cuda()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    batch = (torch.randn(4, 32768, 64, device="cuda"),)
    _, total = torch.cuda.mem_get_info()
    before = snapshot(net, optimizer)
    result = probe_micro_batch(net, optimizer, batch, lambda b: net(b[0]).sum(), memory_budget_bytes=4 * total,
                               headroom=1.0, throughput=False, progress_bar=False)
    oom = [t for t in result.trials if not t.ok and t.error and "memory" in t.error.lower()]
    assert oom, [(t.size, t.ok, t.error) for t in result.trials]
    assert 0 < result.max_micro_batch < min(t.size for t in oom)
    assert_same(before, snapshot(net, optimizer))
    x = torch.randn(result.max_micro_batch, 32768, 64, device="cuda")  # the answer really runs a step
    net(x).sum().backward()
    optimizer.step()


def test_tensors_held_only_by_garbage_cycles_do_not_count_against_the_budget():
    """A finished run's tensors can stay on the device until a collection frees their reference cycle (a
    Lightning ``Trainer`` is full of them). The probe collects before it measures, so its answer is the one a
    clean process gets."""
    import gc

    net = bn_net()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    batch = conv_batch()
    trained(net, optimizer, batch)

    def probe():
        return probe_micro_batch(net, optimizer, batch, loss_of(net), memory_budget_bytes=256 * MiB, headroom=0.9,
                                 throughput=False, progress_bar=False).max_micro_batch

    clean = probe()
    gc.disable()  # the cycle must survive until the probe runs
    try:
        cycle: list = [torch.empty(160 * MiB, dtype=torch.uint8, device="cuda")]
        cycle.append(cycle)
        del cycle
        assert probe() >= 0.9 * clean
    finally:
        gc.enable()
