"""ProbeResult: JSON-safe both ways, a one-line summary, and a progress bar that can be switched off."""

import json
import math

import torch
import torch.nn.functional as F

from gns_callback.probe import ProbeResult, Trial, probe_micro_batch
from gns_callback.probe.timing import Timing
from tests.helpers import mlp


def probe(**kwargs):
    net = mlp()
    batch = (torch.randn(8, 64), torch.randint(0, 10, (8,)))
    return probe_micro_batch(net, torch.optim.SGD(net.parameters(), lr=0.1), batch,
                             lambda b: F.cross_entropy(net(b[0]), b[1]), memory_budget_bytes=100_000,
                             timed_steps=2, timing_budget_s=0.1, **kwargs)


def test_to_dict_is_json_safe_and_round_trips():
    result = probe(progress_bar=False)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert ProbeResult.from_dict(data) == result
    assert set(data) >= {"max_micro_batch", "fixed_bytes", "bytes_per_sample", "budget_bytes", "trials", "device",
                         "throughput"}
    assert data["trials"][0].keys() >= {"size", "ok", "measured_bytes", "samples_per_s"}


def test_non_finite_values_become_null():
    result = ProbeResult(max_micro_batch=0, fixed_bytes=math.nan, bytes_per_sample=None, budget_bytes=10,
                         headroom=0.85, device="cpu", measure="accounting",
                         trials=[Trial(4, False, error="over budget", timing=Timing.single(0.0))])  # 4 / 0 s
    text = json.dumps(result.to_dict(), allow_nan=False)
    assert '"fixed_bytes": null' in text and '"samples_per_s": null' in text


def test_summary_is_one_line():
    result = probe(progress_bar=False)
    line = result.summary()
    assert "\n" not in line and f"max micro-batch {result.max_micro_batch}" in line and "samples/s" in line


def test_progress_bar_on_rank_zero_can_be_disabled(capsys):
    probe(progress_bar=True)
    assert "Probing micro-batch" in capsys.readouterr().err
    probe(progress_bar=False)
    assert "Probing micro-batch" not in capsys.readouterr().err
