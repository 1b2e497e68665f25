"""Unbiased two-batch-size estimators of |G|² and tr(Σ) (McCandlish et al. 2018, App. A.1).

For a mean-reduced loss over a batch of ``B`` examples drawn i.i.d. (with replacement),
``E|G_B|² = |G|² + tr(Σ)/B``. Measuring the squared gradient norm at two batch sizes ``b < B``
gives two linear equations in the two unknowns, hence the unbiased estimators

    |G|²  ≈ (B·|G_B|² − b·|G_b|²) / (B − b)
    tr(Σ) ≈ (|G_b|² − |G_B|²) / (1/b − 1/B)

Everything here is plain arithmetic: it works on Python floats, NumPy arrays and torch tensors alike.
``b`` and ``B`` may be *effective* batch sizes: when the measured gradient is a weighted
combination ``Σ_j w_j ḡ_j`` of batch means ``ḡ_j`` of sizes ``b_j`` (``Σ w_j = 1``), its squared norm
has expectation ``|G|² + tr(Σ)·Σ_j w_j²/b_j``, i.e. an effective batch size ``1/Σ_j w_j²/b_j``;
see :func:`effective_batch_size`.
"""

from __future__ import annotations

from typing import Sequence, TypeVar

Number = TypeVar("Number")  # float, numpy array or torch tensor


def grad_sq_norm_estimate(small_sq: Number, big_sq: Number, b_small: Number, b_big: Number) -> Number:
    """Unbiased ``|G|² ≈ (B·|G_B|² − b·|G_b|²)/(B − b)`` from squared norms at batch sizes ``b < B``."""
    return (b_big * big_sq - b_small * small_sq) / (b_big - b_small)


def trace_sigma_estimate(small_sq: Number, big_sq: Number, b_small: Number, b_big: Number) -> Number:
    """Unbiased ``tr(Σ) ≈ (|G_b|² − |G_B|²)/(1/b − 1/B)`` from squared norms at batch sizes ``b < B``."""
    return (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)


def effective_batch_size(batch_sizes: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Effective batch size ``1/Σ_j w_j²/b_j`` of the combination ``Σ_j w_j ḡ_j`` of batch means.

    With ``weights=None`` the combination is the plain mean of the batch means (``w_j = 1/n``),
    which is what the optimizer steps on under gradient accumulation and DDP with a mean-reduced loss.
    Equal sizes ``b`` give ``n·b``; examples weighted by size (``w_j = b_j/Σb``) give ``Σ b_j``.
    """
    n = len(batch_sizes)
    if n == 0:
        raise ValueError("batch_sizes must not be empty")
    if weights is None:
        weights = [1.0 / n] * n
    return 1.0 / sum(w * w / b for w, b in zip(weights, batch_sizes))
