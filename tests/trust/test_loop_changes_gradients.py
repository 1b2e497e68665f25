"""A loop of one's own that changes the gradients between backward and ``meter.step()`` (:mod:`gns_callback.
grad_watch`): the meter marks the end of each backward pass that fills ``.grad`` itself, so nothing needs calling.

Before, the mark came only from ``meter.backward_done()``, which a loop rarely calls: ``clip_grad_norm_`` before
``meter.step()`` at the median batch-gradient norm read B_simple = 128.2 (95% CI 117.5–140.9) against an exact 68.0
on the digits MLP, 0 of 5 intervals holding it (``benchmarks/loop_gradient_changes.py``). In one process the meter
now reads ``|G_B|²`` as backward left it; with ``reduce`` (several ranks, where a loop may reduce the gradients
itself after backward) a change stops the meter, with the fix. Under DDP the mark comes after the gradients'
reduction (:func:`gns_callback.backward_passes.at_the_end_of_the_pass`).
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleMeter
from tests.helpers import mlp

STEPS = 150
PROBLEM_PHRASE = "the gradients changed between the end of backward and the optimizer step"


def clip_norm(max_norm):
    return lambda net: torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)


def clip_value(value):
    return lambda net: torch.nn.utils.clip_grad_value_(net.parameters(), value)


def measure(net, x, y, change, seed=0, steps=STEPS, reduce=None, batch=32):
    """A loop at fixed parameters: backward, ``change(net)``, ``meter.step()``; the meter and its warnings."""
    g = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught, GradientNoiseScaleMeter(net, reduce=reduce) as meter:
        warnings.simplefilter("always")
        for _ in range(steps):
            rows = torch.randint(0, len(x), (batch,), generator=g)
            F.cross_entropy(net(x[rows]), y[rows]).backward()
            change(net)
            meter.step()
            net.zero_grad()
    return meter, [str(w.message) for w in caught]


def zero_half_of_the_first_layer(net):
    net[0].weight.grad[:16] = 0


@pytest.mark.parametrize("change", [clip_norm(0.55), clip_norm(0.05), clip_value(1e-3), zero_half_of_the_first_layer],
                         ids=["clip at the median norm", "clip hard", "clip each value", "zero part of a layer"])
def test_a_loop_that_changes_the_gradients_before_the_read_is_measured_as_backward_left_them(digits, exact_gns,
                                                                                            change):
    """One process: the per-example norms and the total squared norm kept at the end of backward come from the same
    passes, so the read takes that total (kept at the first step, and at every step after one that changed)."""
    x, y = digits
    exact = exact_gns(mlp(), F.cross_entropy, x, y)[0]
    changed, caught = measure(mlp(), x, y, change)
    plain, _ = measure(mlp(), x, y, lambda net: None)
    assert not caught
    estimate = changed.run_estimate
    assert estimate.measured and estimate.skipped_steps == 0 and estimate.steps == STEPS
    assert estimate.ci_low <= exact <= estimate.ci_high
    assert estimate.b_simple == pytest.approx(plain.run_estimate.b_simple, rel=0.05)


def test_with_several_passes_a_step_a_change_stops_with_the_fix(digits):
    """Accumulated passes: a change between them would already be in the last mark's total, so none is read in place
    of ``.grad``; a change after the last one stops the meter (one that leaves |G_B|² as it was is measured)."""
    x, y = digits
    for max_norm, measured in ((1e6, True), (0.05, False)):
        net, g = mlp(), torch.Generator().manual_seed(0)
        with warnings.catch_warnings(record=True), GradientNoiseScaleMeter(net, method="micro_batch") as meter:
            warnings.simplefilter("always")
            for _ in range(30):
                for _ in range(4):
                    rows = torch.randint(0, len(x), (8,), generator=g)
                    (F.cross_entropy(net(x[rows]), y[rows]) / 4).backward()
                clip_norm(max_norm)(net)
                meter.step(micro_batch_size=8)
                net.zero_grad()
        assert meter.run_estimate.measured == measured
        if not measured:
            assert PROBLEM_PHRASE in meter.run_estimate.failure


def test_a_change_that_starts_mid_run_skips_its_first_step_only(digits):
    """No total is kept while the loop leaves the gradients alone; the first step that changes them is left out."""
    x, y = digits
    steps = iter(range(STEPS))
    meter, caught = measure(mlp(), x, y, lambda net: clip_norm(0.05)(net) if next(steps) >= 20 else None)
    assert not caught and meter.run_estimate.skipped_steps == 1 and meter.run_estimate.steps == STEPS - 1


def _ddp_worker(rank: int, root: str, clip: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["GNS_TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        from sklearn.datasets import load_digits
        data = load_digits()
        x, y = torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)
        net = torch.nn.parallel.DistributedDataParallel(mlp())

        def reduce(tensor):
            dist.all_reduce(tensor)
            return tensor

        meter, _ = measure(net, x, y, clip_norm(0.3) if clip else (lambda _: None), seed=2 + rank, steps=60,
                           reduce=reduce, batch=16)
        meter.settle()
        torch.save(meter.run_estimate.to_dict(), f"{root}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("clip", [False, True], ids=["as it is", "clipped before the read"])
def test_under_ddp_the_mark_comes_after_the_reduction(digits, exact_gns, tmp_path, monkeypatch, clip):
    """A plain DDP loop (2 processes, gloo): DDP writes the reduced gradients into ``.grad`` as the backward pass
    ends; a mark taken before that would find every step changed."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("GNS_TEST_PORT", str(s.getsockname()[1]))
    mp.spawn(_ddp_worker, args=(str(tmp_path), clip), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert ranks[0] == ranks[1]
    if clip:
        assert PROBLEM_PHRASE in ranks[0]["failure"]
        return
    x, y = digits
    exact = exact_gns(mlp(), F.cross_entropy, x, y)[0]
    assert ranks[0]["failure"] is None and ranks[0]["steps"] == 60
    assert ranks[0]["ci_low"] <= exact <= ranks[0]["ci_high"]


def test_a_gradient_left_from_before_the_meter_then_clipping_is_measured(digits, exact_gns):
    """The first step is skipped (a gradient from before the meter); its marks go with it, so the next step is a
    step of one backward pass and its clipping is read as backward left the gradients."""
    x, y = digits
    exact = exact_gns(mlp(), F.cross_entropy, x, y)[0]
    net = mlp()
    F.cross_entropy(net(x[:64]), y[:64]).backward()  # left in .grad before the meter was attached
    meter, caught = measure(net, x, y, clip_norm(0.05))
    estimate = meter.run_estimate
    assert not caught and estimate.skipped_steps == 1 and estimate.steps == STEPS - 1
    assert estimate.ci_low <= exact <= estimate.ci_high
