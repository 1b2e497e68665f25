import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """These models are tiny: intra-op threads only add contention (20× slower on a busy 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
