import warnings

import pytest
import torch
from sklearn.datasets import load_digits

from gns_callback.exact import exact_b_simple

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Each test runs in its own directory: nothing it writes (reports, lightning_logs) lands in the repository."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def file_system_sharing():
    """For ddp_spawn tests: sending CPU tensors to spawned workers can fail with "unable to resize file" under
    the default sharing strategy (seen on these machines)."""
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(previous)


@pytest.fixture
def fresh_compiler():
    """For tests that ``torch.compile``: the compiled graphs they leave are dropped (a later test with a function of
    the same code would reuse them)."""
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's bundled 8×8 digits (1797 real images), pixels scaled to [0, 1]."""
    data = load_digits()
    return torch.tensor(data.data, dtype=torch.float32) / 16.0, torch.tensor(data.target)


@pytest.fixture(scope="session")
def exact_gns():
    """``exact_gns(net, loss_fn, x, y) -> (B_simple, |G|², tr Σ)`` by brute force over the whole data set."""

    return exact_b_simple
