"""The ranks' agreement, with two threads standing in for two ranks (``reduce_min``): the minimum wins, and an
error on one rank reaches every rank instead of leaving the other waiting in a collective."""

import threading

import torch
import torch.nn.functional as F

from gns_callback.probe import ProbeFailedOnOtherRank, probe_micro_batch
from tests.helpers import mlp


class ThreadAllReduceMin:
    """An all-reduce(MIN) between ``n`` threads; a 30 s timeout turns a deadlock into a test failure."""

    def __init__(self, n=2):
        self.barrier = threading.Barrier(n, timeout=30)
        self.lock = threading.Lock()
        self.values = []
        self.calls = 0  # collectives entered, summed over ranks

    def __call__(self, tensor):
        with self.lock:
            self.values.append(tensor.clone())
        self.barrier.wait()
        result = torch.stack(self.values).min(dim=0).values
        self.barrier.wait()
        with self.lock:
            self.values.clear()
            self.calls += 1
        self.barrier.wait()
        return result


def run_ranks(make_step, reduce_min):
    results, errors = {}, {}

    def rank(r):
        net = mlp(seed=r)
        batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
        try:
            results[r] = probe_micro_batch(net, None, batch, make_step(r, net), reduce_min=reduce_min,
                                           throughput_sizes=[4], timed_steps=1, timing_budget_s=0.05, progress_bar=False,
                                           memory_budget_bytes=10**8, max_batch_size=512)
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "deadlock"
    return results, errors


def oom_above(thresholds):
    def make_step(r, net):
        def step(batch):
            if batch[0].shape[0] > thresholds[r]:
                raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
            return F.cross_entropy(net(batch[0]), batch[1])
        return step
    return make_step


def test_the_minimum_over_ranks_wins_and_is_confirmed_on_every_rank():
    results, errors = run_ranks(oom_above({0: 300, 1: 90}), ThreadAllReduceMin())
    assert not errors
    agreed = results[1].max_micro_batch
    assert 86 <= agreed <= 90  # rank 1's own bisection (to within max(1, 5%))
    assert results[0].max_micro_batch == agreed
    assert any(t.size > 250 and t.ok for t in results[0].trials)  # rank 0 found more on its own
    assert any(t.size == agreed and t.ok for t in results[0].trials)  # and then ran the agreed size
    assert results[0].throughput.keys() == results[1].throughput.keys() == {4, agreed}
    assert results[0].throughput == results[1].throughput  # the slower rank's samples/s


def test_an_error_on_one_rank_is_raised_on_every_rank_without_deadlock():
    def make_step(r, net):
        def step(batch):
            if r == 1 and batch[0].shape[0] == 32:
                raise ValueError("rank 1 has a bug")
            return F.cross_entropy(net(batch[0]), batch[1])
        return step

    reduce_min = ThreadAllReduceMin()
    results, errors = run_ranks(make_step, reduce_min)
    assert not results
    assert isinstance(errors[1], ValueError)
    assert isinstance(errors[0], ProbeFailedOnOtherRank)
    assert reduce_min.calls == 2  # each rank entered exactly one collective: both stopped at the first agreement
