"""Squared norms of gradients (gns_callback/norms.py) against float64 sums, for every dtype a model trains in."""

import pytest
import torch

from gns_callback.norms import squared_norm, squared_norm_sum


def reference(tensors):
    return sum(float(t.double().square().sum()) for t in tensors)


@pytest.mark.parametrize("dtypes", [
    (torch.float32,), (torch.float64,), (torch.float16, torch.bfloat16),
    (torch.float64, torch.float32, torch.bfloat16),  # a float64 model with a low-precision buffer, say
])
def test_squared_norm_sum_of_any_dtype_mix(dtypes):
    """float64 gradients (``Trainer(precision="64-true")``, ``model.double()``) used to raise inside backward:
    ``_foreach_norm`` refuses to narrow them to its float32 accumulation."""
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(17, 5, generator=generator).to(dtype) for dtype in dtypes for _ in range(2)]
    total = squared_norm_sum(tensors)
    assert total.dtype == torch.float32 and total.dim() == 0
    assert float(total) == pytest.approx(reference(tensors), rel=1e-6)
    assert float(total) == pytest.approx(sum(float(squared_norm(t)) for t in tensors), rel=1e-6)


def test_squared_norm_sum_reads_sparse_gradients_by_their_values():
    """An ``nn.Embedding(sparse=True)``'s gradient, uncoalesced (a row looked up twice): ``_foreach_norm`` can't read
    it, and the run crashed at its first optimizer step under ``micro_batch``."""
    table = torch.nn.Embedding(7, 3, sparse=True)
    table(torch.tensor([[1, 4, 1]])).square().sum().backward()
    dense = torch.randn(5, 2)
    total = squared_norm_sum([table.weight.grad, dense])
    assert float(total) == pytest.approx(reference([table.weight.grad.to_dense(), dense]), rel=1e-6)
