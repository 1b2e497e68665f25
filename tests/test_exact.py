"""The brute-force reference itself: per-example gradients by a Python loop, and the population formulas."""

import pytest
import torch
import torch.nn.functional as F

from gns_callback.exact import exact_b_simple, exact_noise_scale, per_example_gradients


def test_per_example_gradients_match_a_loop():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 1, 0, 1])
    rows = per_example_gradients(net, F.cross_entropy, x, y, chunk=2)
    for i in range(5):
        net.zero_grad()
        F.cross_entropy(net(x[i : i + 1]), y[i : i + 1]).backward()
        expected = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).double()
        assert torch.allclose(rows[i], expected, atol=1e-6)


def test_exact_noise_scale_of_known_rows():
    rows = torch.tensor([[1.0, 0.0], [3.0, 2.0]], dtype=torch.float64)  # G = (2, 1), deviations ±(1, 1)
    b, grad_sq, trace = exact_noise_scale(rows)
    assert (grad_sq, trace) == pytest.approx((5.0, 2.0)) and b == pytest.approx(0.4)


def test_a_sparse_embedding_reads_as_its_dense_twin():
    """``nn.Embedding(sparse=True)`` gives sparse gradients, which neither path could reshape before."""
    tokens, labels = torch.randint(0, 17, (40, 6), generator=torch.Generator().manual_seed(0)), torch.arange(40) % 3

    def model(sparse):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(17, 4, sparse=sparse), torch.nn.Flatten(), torch.nn.Linear(24, 3))

    sparse, dense = (exact_b_simple(model(s), F.cross_entropy, tokens, labels) for s in (True, False))
    assert sparse == pytest.approx(dense, rel=1e-6)
