"""Device values read on the host a step late: in order, the newest ``keep`` left in flight, and a meter whose
steps travel this way reads every step it measured whenever a result is asked for."""

import pytest
import torch
import torch.nn.functional as F

from gns_callback import GradientNoiseScaleMeter
from gns_callback.deferred import DeferredReads, to_host_later
from tests.helpers import mlp


def test_values_come_back_in_order_with_their_context_and_the_newest_kept():
    reads = DeferredReads()
    for i in range(3):
        reads.push(torch.tensor([float(i), 2.0 * i], dtype=torch.float64), context=f"step {i}")
    assert [(v, c) for v, c in reads.pop(keep=1)] == [([0.0, 0.0], "step 0"), ([1.0, 2.0], "step 1")]
    assert len(reads) == 1
    assert list(reads.pop()) == [([2.0, 4.0], "step 2")] and len(reads) == 0


def test_a_cpu_vector_needs_no_copy_and_no_event():
    vector = torch.arange(3.0)
    host, event = to_host_later(vector)
    assert event is None and host.data_ptr() == vector.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on a GPU machine only)")
def test_a_cuda_vector_is_copied_into_pinned_memory_behind_an_event():
    vector = torch.arange(5.0, dtype=torch.float64, device="cuda") * 3
    host, event = to_host_later(vector)
    assert host.is_pinned() and event is not None
    reads = DeferredReads()
    reads.push(vector, None)
    assert list(reads.pop()) == [([0.0, 3.0, 6.0, 9.0, 12.0], None)]


def test_a_meter_reading_a_step_late_reports_every_step_measured(digits):
    """With ``reduce`` the newest step is still in flight after ``step()``; reading the estimate, the critical
    batch or the state takes it in, so nothing is ever a step behind for the reader."""
    x, y = digits
    net = mlp()
    g = torch.Generator().manual_seed(0)
    with GradientNoiseScaleMeter(net, method="per_example", reduce=lambda t: t) as meter:
        for step in range(1, 6):
            i = torch.randint(0, len(x), (16,), generator=g)
            F.cross_entropy(net(x[i]), y[i]).backward()
            meter.step()
            net.zero_grad()
            assert len(meter._reads) == 1  # this step's numbers are on their way
            assert meter.run_estimate.steps == step and len(meter._reads) == 0
        i = torch.randint(0, len(x), (16,), generator=g)
        F.cross_entropy(net(x[i]), y[i]).backward()
        meter.step()
        assert round(float(meter.run.sums[0])) == 5  # step 6 in flight ...
        meter.state_dict()
        assert round(float(meter.run.sums[0])) == 6 and len(meter._reads) == 0  # ... taken in by the checkpoint
