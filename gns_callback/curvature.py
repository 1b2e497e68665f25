"""Sharpness: the largest eigenvalue ``λ_max`` of the loss Hessian, by power iteration on Hessian-vector products.

``H v`` costs one double backward through the graph of the gradient (Pearlmutter 1994, "Fast Exact
Multiplication by the Hessian"); a few tens of products give ``λ_max`` (power iteration on the Rayleigh quotient,
as in Yao et al. 2020, "PyHessian", arXiv:1912.07145). Plain power iteration finds the eigenvalue of largest
*magnitude*; when that one is negative, a second run on ``H − λ·I`` finds the largest algebraic one.

Why it matters for the learning rate: gradient descent on a quadratic with curvature ``λ`` is stable only for
``lr < 2/λ`` (``2(1+β)/λ`` with heavy-ball momentum β); Cohen et al. 2021, "Gradient Descent on Neural
Networks Typically Occurs at the Edge of Stability" (arXiv:2103.00065) find trained networks at that limit.
See :mod:`gns_callback.recommendation.stability`. Pure torch; no Lightning.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

Vector = list[torch.Tensor]


def hessian_vector_product_fn(
    loss_fn: Callable[[], torch.Tensor], params: Sequence[torch.Tensor]
) -> Callable[[Vector], Vector]:
    """``v ↦ H v`` for the Hessian of ``loss_fn()`` at the current ``params`` (one forward and backward now,
    one double backward per product). ``v`` and ``H v`` are lists shaped like ``params``.

    Parameters whose gradient does not depend on any parameter (unused, or entering the loss linearly) have
    zero rows and columns in ``H``.
    """
    params = list(params)
    grads = torch.autograd.grad(loss_fn(), params, create_graph=True, allow_unused=True)
    live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]

    def hvp(vector: Vector) -> Vector:
        out = [torch.zeros_like(p) for p in params]
        if not live:
            return out
        products = torch.autograd.grad(
            [grads[i] for i in live], [params[i] for i in live], grad_outputs=[vector[i] for i in live],
            retain_graph=True, allow_unused=True,
        )
        for i, h in zip(live, products):
            if h is not None:
                out[i] = h.detach()
        return out

    return hvp


def _dot(a: Vector, b: Vector) -> float:
    """``Σ_tensors xᵀy``: one ``torch.dot`` per tensor in its own dtype (no float64 copies of the vectors, which
    made this 6× slower on a 0.7M-parameter MLP), the per-tensor results summed in float64."""
    return float(sum(torch.dot(x.reshape(-1), y.reshape(-1)).double() for x, y in zip(a, b)))


def _scaled(a: Vector, c: float) -> Vector:
    return [x * c for x in a]


def power_iteration(
    matvec: Callable[[Vector], Vector], start: Vector, *, max_iterations: int = 50, rtol: float = 1e-4
) -> tuple[float, Vector]:
    """``(λ, v)``: the eigenvalue of largest magnitude of a symmetric operator and its unit eigenvector.

    Iterates ``v ← A v/|A v|`` and stops when the Rayleigh quotient ``vᵀ A v`` changes by at most ``rtol``
    (relative) between iterations, or after ``max_iterations``.
    """
    v = _scaled(start, 1.0 / math.sqrt(_dot(start, start)))
    value = math.nan
    for _ in range(max_iterations):
        w = matvec(v)
        new = _dot(v, w)
        norm = math.sqrt(_dot(w, w))
        if norm == 0.0:
            return 0.0, v
        v = _scaled(w, 1.0 / norm)
        if abs(new - value) <= rtol * abs(new):
            return new, v
        value = new
    return value, v


def sharpness(
    loss_fn: Callable[[], torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    max_iterations: int = 50,
    rtol: float = 1e-4,
    seed: int = 0,
) -> float:
    """``λ_max``, the largest eigenvalue of the Hessian of ``loss_fn()`` with respect to ``params``.

    Args:
        loss_fn: a closure that computes the loss (e.g. the mean loss over a fixed, large batch) from the current
            parameters; called once.
        params: the parameters (tensors with ``requires_grad``).
        max_iterations, rtol: power-iteration budget and stopping tolerance (each iteration is one
            Hessian-vector product, about the cost of two backward passes).
        seed: for the random start vector.

    >>> w = torch.tensor([1.0, 1.0], requires_grad=True)
    >>> round(sharpness(lambda: 3.0 * w[0] ** 2 + 0.5 * w[1] ** 2, [w]), 4)  # Hessian diag(6, 1)
    6.0
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("sharpness(params=...): no parameter requires grad")
    hvp = hessian_vector_product_fn(loss_fn, params)
    gen = torch.Generator().manual_seed(seed)
    start = [torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) for p in params]
    top, _ = power_iteration(hvp, start, max_iterations=max_iterations, rtol=rtol)
    if top >= 0:
        return top
    # The dominant eigenvalue is negative: H − top·I is positive semi-definite, its largest is λ_max − top.
    shifted, _ = power_iteration(
        lambda v: [h - top * x for h, x in zip(hvp(v), v)], start, max_iterations=max_iterations, rtol=rtol
    )
    return shifted + top


def lanczos_top_eigenvalue(
    matvec: Callable[[Vector], Vector], start: Vector, *, max_iterations: int = 30, rtol: float = 1e-3
) -> float:
    """The largest (algebraic) eigenvalue of a symmetric operator by the Lanczos iteration (Lanczos 1950; Golub &
    Van Loan, "Matrix Computations", sec. 10.1), three vectors of memory.

    After ``k`` products the operator restricted to the Krylov space of ``start`` is the tridiagonal ``T_k``
    (diagonal ``α_j = q_jᵀ A q_j``, off-diagonal ``β_j = |r_j|``); its top eigenvalue ``θ`` (the top Ritz value)
    never exceeds ``λ_max`` and converges much faster than power iteration (error ∝ a Chebyshev polynomial in
    the gap rather than a power of ``λ₂/λ₁``). Stops when the Ritz residual ``|A y − θ y| = β_k·|s_k|``
    (``s`` the top eigenvector of ``T_k``) is at most ``rtol·|θ|``: an eigenvalue of ``A`` then lies within that
    distance of ``θ``. No reorthogonalization: lost orthogonality only repeats converged Ritz values ("ghosts"),
    it does not move the top one.

    >>> w = torch.tensor([1.0, 1.0, 1.0], requires_grad=True)
    >>> hvp = hessian_vector_product_fn(lambda: 3.0 * w[0] ** 2 + w[1] ** 2 - 2.0 * w[2] ** 2, [w])
    >>> round(lanczos_top_eigenvalue(hvp, [torch.ones(3)]), 4)  # Hessian diag(6, 2, -4)
    6.0
    """
    q = _scaled(start, 1.0 / math.sqrt(_dot(start, start)))
    previous: Vector = [torch.zeros_like(x) for x in q]
    alphas: list[float] = []
    betas: list[float] = []
    beta, top = 0.0, math.nan
    for _ in range(max_iterations):
        w = matvec(q)
        alphas.append(_dot(w, q))
        w = [wi - alphas[-1] * qi - beta * pi for wi, qi, pi in zip(w, q, previous)]
        beta = math.sqrt(_dot(w, w))
        top, residual = _top_ritz(alphas, betas, beta)
        if beta == 0.0 or residual <= rtol * abs(top):
            break
        betas.append(beta)
        previous, q = q, _scaled(w, 1.0 / beta)
    return top


def _top_ritz(alphas: list[float], betas: list[float], beta: float) -> tuple[float, float]:
    """``(θ, β·|s_k|)``: the top eigenvalue of the Lanczos tridiagonal and its Ritz residual."""
    t = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        t = t + torch.diag(off, 1) + torch.diag(off, -1)
    values, vectors = torch.linalg.eigh(t)
    return float(values[-1]), beta * abs(float(vectors[-1, -1]))
