"""Both Lightning namespaces: one callback class for either Trainer, errors and classes of the namespace in use."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gns_callback import GradientNoiseScaleCallback
from gns_callback.lightning import compat


def test_the_callback_is_a_callback_of_every_installed_namespace(namespace):
    assert issubclass(GradientNoiseScaleCallback, namespace.module.Callback)
    assert namespace.module.Callback in compat.CALLBACK_BASES


def test_namespace_of_a_trainer(namespace):
    assert compat.namespace_of(namespace.trainer()) is namespace.module


def test_errors_are_of_the_trainer_namespace(namespace, other_namespace):
    error = compat.misconfiguration(namespace.trainer(), "the message")
    assert isinstance(error, namespace.MisconfigurationException) and str(error) == "the message"
    # the two namespaces' classes differ (lightning.fabric's vs lightning_fabric's): the other one must not be used
    assert other_namespace.MisconfigurationException is not namespace.MisconfigurationException
    assert not isinstance(error, other_namespace.MisconfigurationException)


def test_classes_are_found_in_every_installed_namespace(namespace):
    callbacks, strategies = namespace.sub("callbacks"), namespace.sub("strategies")
    assert callbacks.GradientAccumulationScheduler in compat.callback_types("GradientAccumulationScheduler")
    assert strategies.FSDPStrategy in compat.strategy_types("FSDPStrategy")
    assert len(compat.strategy_types("DDPStrategy")) == len(compat.MODULES)


def test_a_class_no_namespace_has_is_an_empty_tuple():
    assert compat.strategy_types("NoSuchStrategy") == ()
    assert compat.callback_types("NoSuchCallback") == ()


ONE_NAMESPACE = """
import json, sys
sys.modules[{hidden!r}] = None   # the other namespace is not installed: any import of it fails
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from sklearn.datasets import load_digits
from {used} import LightningModule, Trainer
from gns_callback import GradientNoiseScaleCallback
from gns_callback.demo import main as demo

data = load_digits()
x, y = torch.tensor(data.data, dtype=torch.float32) / 16, torch.tensor(data.target)

class Digits(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))
    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)
    def train_dataloader(self):
        return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

torch.manual_seed(0)
cb = GradientNoiseScaleCallback(probe=True, verbose=False)   # the first-batch check, the probe, the sharpness monitor
Trainer(max_epochs=1, callbacks=[cb], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False).fit(Digits())
demo(["--epochs", "1", "--no-probe", "--out", sys.argv[1]])
loaded = [m for m in sys.modules if m.split(".")[0] == {hidden!r} and sys.modules[m] is not None]
print(json.dumps({{"steps": cb.run_estimate.steps, "b_simple": cb.run_estimate.b_simple,
                   "probed": cb.probe.measured, "loaded": loaded}}))
"""


@pytest.mark.parametrize("used,hidden", [("lightning.pytorch", "pytorch_lightning"),
                                         ("pytorch_lightning", "lightning")])
def test_the_callback_needs_only_one_namespace(used, hidden, tmp_path):
    """With only ``lightning`` installed, ``from gns_callback import GradientNoiseScaleCallback`` raised
    ``ModuleNotFoundError: pytorch_lightning`` (the probe's adapter imported it by name); the demo did too."""
    pytest.importorskip(used)
    script = ONE_NAMESPACE.format(used=used, hidden=hidden)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["steps"] == 57 and result["b_simple"] > 0 and result["probed"] and result["loaded"] == []
    assert list(tmp_path.rglob("gns_report.json"))
