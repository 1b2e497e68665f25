"""Sharpness by power iteration against the exact Hessian (``torch.autograd.functional.hessian``) on real data."""

import doctest

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from gns_callback import curvature
from gns_callback.curvature import hessian_vector_product_fn, power_iteration, sharpness


def _flat_loss(net, x, y):
    """The loss as a function of one flat parameter vector, and that vector at the current parameters."""
    names = [n for n, _ in net.named_parameters()]
    shapes = [p.shape for _, p in net.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])

    def loss(theta):
        chunks, start = {}, 0
        for name, shape in zip(names, shapes):
            size = shape.numel()
            chunks[name] = theta[start : start + size].reshape(shape)
            start += size
        return F.cross_entropy(functional_call(net, chunks, (x,)), y)

    return loss, flat


def _exact_hessian(net, x, y):
    loss, flat = _flat_loss(net, x, y)
    return torch.autograd.functional.hessian(loss, flat)


def _tiny_mlp(seed=0, hidden=6):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 10))


@pytest.fixture(scope="module")
def sample(digits):
    x, y = digits
    return x[:200].double(), y[:200]


def test_hessian_vector_product_matches_the_exact_hessian(sample):
    x, y = sample
    net = _tiny_mlp().double()
    hessian = _exact_hessian(net, x, y)
    hvp = hessian_vector_product_fn(lambda: F.cross_entropy(net(x), y), list(net.parameters()))
    v = [torch.randn_like(p) for p in net.parameters()]
    got = torch.cat([h.reshape(-1) for h in hvp(v)])
    want = hessian @ torch.cat([t.reshape(-1) for t in v])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sharpness_is_the_top_eigenvalue_of_a_tiny_mlp_on_digits(sample, seed):
    x, y = sample
    net = _tiny_mlp(seed).double()
    exact = torch.linalg.eigvalsh(_exact_hessian(net, x, y)).max().item()
    got = sharpness(lambda: F.cross_entropy(net(x), y), list(net.parameters()), max_iterations=500, rtol=1e-10,
                    seed=seed)
    assert got == pytest.approx(exact, rel=1e-6)


def test_sharpness_of_logistic_regression_on_digits_in_float32(digits):
    """The default budget (50 iterations, rtol 1e-4) in float32 on all 1797 examples: within 1% of exact."""
    x, y = digits
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 10)
    for _ in range(30):  # move away from the initialisation so that the spectrum is not degenerate
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= 0.5 * p.grad
    exact = torch.linalg.eigvalsh(_exact_hessian(net.double(), x.double(), y)).max().item()
    net = net.float()
    got = sharpness(lambda: F.cross_entropy(net(x), y), list(net.parameters()))
    assert got == pytest.approx(exact, rel=1e-2)


def test_negative_dominant_eigenvalue_still_gives_the_largest():
    """Hessian diag(−5, 1, 2): the largest-magnitude eigenvalue is −5; the stability-relevant one is 2."""
    w = torch.tensor([0.3, -0.2, 0.5], dtype=torch.float64, requires_grad=True)
    curv = torch.tensor([-5.0, 1.0, 2.0], dtype=torch.float64)
    assert sharpness(lambda: 0.5 * (curv * w**2).sum(), [w], max_iterations=500, rtol=1e-12) == pytest.approx(2.0)
    # A concave loss: λ_max is negative and reported as such.
    assert sharpness(lambda: -(w**2).sum() - 2 * w[0] ** 2, [w], max_iterations=500, rtol=1e-12) == pytest.approx(-2.0)


def test_power_iteration_on_a_matrix_and_unused_parameters():
    a = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    value, vec = power_iteration(lambda v: [a @ v[0]], [torch.tensor([1.0, 0.0], dtype=torch.float64)],
                                 max_iterations=200, rtol=1e-14)
    assert value == pytest.approx(torch.linalg.eigvalsh(a).max().item())
    used = torch.tensor([1.0], requires_grad=True)
    unused = torch.tensor([1.0], requires_grad=True)
    linear = torch.tensor([1.0], requires_grad=True)
    assert sharpness(lambda: 2.0 * used[0] ** 2 + 3.0 * linear[0], [used, unused, linear]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="requires grad"):
        sharpness(lambda: used.sum(), [torch.zeros(2)])


def test_docstring_examples():
    assert doctest.testmod(curvature).failed == 0
