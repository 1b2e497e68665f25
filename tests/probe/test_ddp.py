"""DDP for real: 2 CPU processes (gloo, ddp_spawn) probe, agree on the minimum, and keep training."""

import json

import pytest
from torch.multiprocessing.spawn import ProcessExitedException

from tests.helpers import mlp, quiet_trainer
from tests.probe.models import ProbeAtBatch, ThresholdClassifier, digits_loader


pytestmark = pytest.mark.usefixtures("file_system_sharing")


# batch 0: both ranks OOM above 20; batch 1: rank 0 above 24, rank 1 above 12 (a lower threshold).
THRESHOLDS = {0: [20, 20], 1: [24, 12]}


def set_thresholds(trainer, pl_module, batch_idx):
    pl_module.thresholds = THRESHOLDS[batch_idx]


def test_ranks_agree_on_the_minimum_without_deadlock(digits, tmp_path):
    x, y = digits
    probe = ProbeAtBatch(at=(0, 1), directory=str(tmp_path), setup=set_thresholds,
                         memory_budget_bytes=10**9, max_batch_size=256, timed_steps=1)
    trainer = quiet_trainer(strategy="ddp_spawn", devices=2, max_steps=4, callbacks=[probe])
    try:
        trainer.fit(ThresholdClassifier(mlp(), thresholds=[1000, 1000], lr=0.1), digits_loader(x[:128], y[:128]))
    except ProcessExitedException as error:
        # gloo can abort a worker while the interpreter shuts down ("terminate called without an active exception"),
        # after its fit ended: seen once in about seven full-suite runs. Tolerated only after both ranks wrote their
        # fit-end record; any failure during the probes or the fit still fails the test.
        ended = all((tmp_path / f"rank{r}_end.json").exists() for r in (0, 1))
        if error.signal_name != "SIGABRT" or not ended:
            raise

    for batch_idx, expected in ((0, 20), (1, 12)):
        ranks = [json.loads((tmp_path / f"rank{r}_batch{batch_idx}.json").read_text()) for r in (0, 1)]
        for result in ranks:
            assert result["max_micro_batch"] == expected
            assert result["world_size"] == 2
            # the agreed size was really run on this rank, and fitted
            assert any(t["size"] == expected and t["ok"] for t in result["trials"])
        own = ("trials", "throughput", "wall_seconds", "timing_seconds")  # each rank's own
        shared = [{k: v for k, v in r.items() if k not in own} for r in ranks]
        assert shared[0] == shared[1]
        assert [p["size"] for p in ranks[0]["throughput"]] == [p["size"] for p in ranks[1]["throughput"]]
    # the rank with the higher threshold found more locally, then agreed on the other's minimum
    rank0 = json.loads((tmp_path / "rank0_batch1.json").read_text())
    assert any(t["size"] == 24 and t["ok"] for t in rank0["trials"])
    ends = [json.loads((tmp_path / f"rank{r}_end.json").read_text()) for r in (0, 1)]
    assert ends == [{"global_step": 4}, {"global_step": 4}]  # training went on after both probes
