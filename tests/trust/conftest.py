import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def _one_thread():
    """Tiny models on a shared CPU: a second intra-op thread only adds contention (up to 40× slower under load)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
