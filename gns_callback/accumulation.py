"""What one optimizer step contributes to the noise-scale estimate (torch, no Lightning).

Over the micro-batches of one optimizer step (all ranks, all accumulation micro-batches) we collect
*small-batch* squared gradient norms — one per micro-batch (``micro_batch`` method) or one per example
(``per_example`` method) — and, at the step, the squared norm of the gradient the optimizer steps on
(the *big batch*). :func:`step_estimates` turns them into that step's unbiased ``tr(Σ)`` and ``|G|²``.

Small batches ("units") of sizes ``s_u`` with means ``ḡ_u`` are averaged weighted by size:
``small_sq = Σ s_u|ḡ_u|²/Σ s_u``, whose expectation is ``|G|² + tr(Σ)·n_units/Σ s_u``, i.e. an effective
small batch ``b = Σ s_u/n_units``. The big gradient is what Lightning steps on: for a mean-reduced loss
the plain mean of the ``n`` micro-batch means (effective size ``n²/Σ_j 1/b_j``, see
:func:`gns_callback.estimators.effective_batch_size`); for a sum-reduced loss the example-weighted mean
(effective size ``Σ_j b_j``). Units may cover only part of a micro-batch (a subset of its examples): the
big batch always counts all ``b_j``. All values stay on the device: no host synchronisation.

**Example units: every pair of examples that can be told apart.** When the units are single examples
(``per_example``), ``|G|²`` is estimated from the products ``g_i·g_l`` of distinct examples, as the U-statistic
``mean_{i≠l} g_i·g_l`` does when every example is measured. The big gradient ``Σ_j w_j S_j`` (``S_j``: micro-batch
``j``'s summed gradient, ``w_j = 1/(n·b_j)`` for a mean loss, ``1/N`` for a sum) has
``|Σ_j w_j S_j|² = Σ_(i,l) w_{j(i)} w_{j(l)} g_i·g_l``. Of its terms only two blocks per micro-batch are not
products of distinct examples, or can't be separated from them: the measured examples' own squares
``D_j = Σ_{i measured} |g_i|²`` and the unmeasured examples' block ``R_j = |Σ_{i unmeasured} g_i|²`` (``k_j`` and
``(b_j − k_j)²`` terms). Subtracting both leaves a weighted sum of distinct-pair products, so

    |G|² ≈ (|G_big|² − Σ_j w_j²·(D_j + R_j)) / (1 − Σ_j w_j²·(k_j + (b_j − k_j)²)),
    tr Σ ≈ mean_{i measured} |g_i|² − |G|²,

unbiased for examples drawn i.i.d. With ``k_j = b_j`` (every example) it is the usual U-statistic; with a subset
it keeps every pair that involves a measured example, including those with the unmeasured ones, rather than the
noisier two-batch-size difference of the subset's mean square and the batch's (which carries the subset's sampling
error of ``mean |g_i|²`` into ``|G|²``, amplified by ``B_simple/B``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Union

import numpy as np
import torch

from gns_callback.blend import PairBlend
from gns_callback.estimators import grad_sq_norm_estimate, trace_sigma_estimate
from gns_callback.scalar_ops import HOST, TORCH, ScalarOps, host_errors_ignored

LossReduction = Literal["mean", "sum"]

#: Order of the entries of :meth:`AccumulationWindow.packed` (summed across ranks by one all-reduce).
PACKED_FIELDS = (
    "unit_sq_sum",
    "unit_size_sum",
    "unit_count",
    "micro_count",
    "micro_inv_size_sum",
    "micro_size_sum",
    "ranks",
    "loss_divisor_sum",
    "example_micro_count",
    "excluded_sq_over_b2",
    "excluded_sq",
    "excluded_terms_over_b2",
    "excluded_terms",
)


class AccumulationWindow:
    """Sums over the micro-batches of one optimizer step, on one rank.

    Each micro-batch adds a device scalar ``Σ_u |ḡ_u|²``-like value and a host-side weight; they are combined
    in :meth:`packed`, once per step, to keep the per-micro-batch cost to a list append.
    """

    def __init__(self, loss_divisor: float = 1.0) -> None:
        self.reset(loss_divisor)

    def reset(self, loss_divisor: float = 1.0) -> None:
        """Empty the window; ``loss_divisor``: what each backward pass's loss was divided by (Lightning:
        ``accumulate_grad_batches``; a plain loop: usually the number of backward passes per step)."""
        self.loss_divisor = float(loss_divisor)
        self._sq_sums: list[torch.Tensor] = []
        self._weights: list[float] = []
        self.unit_size_sum = 0.0
        self.unit_count = 0.0
        self.micro_count = 0
        self.micro_inv_size_sum = 0.0
        self.micro_size_sum = 0.0
        self._excluded_sqs: list[torch.Tensor] = []
        self._excluded_weights: list[tuple[float, float]] = []
        self.excluded_terms_over_b2 = 0.0
        self.excluded_terms = 0.0

    def add_micro_batch(
        self, sq_sum: torch.Tensor, unit_size_sum: float, unit_count: float, micro_size: int, weight: float = 1.0,
        unmeasured_sq: Optional[Union[torch.Tensor, float]] = None,
    ) -> None:
        """Add one micro-batch of ``micro_size`` examples whose units (all of it, or a subset of its examples)
        contribute ``Σ_u s_u·|ḡ_u|² = weight·sq_sum`` (still AMP-scaled is fine).

        ``unmeasured_sq``: the units are single examples, ``unit_count`` of them measured, and this is
        ``|Σ_{i unmeasured} g_i|²`` (0 when every example is measured) on ``sq_sum``'s scale: ``|G|²`` then comes
        from distinct-example pairs (module docstring)."""
        self._sq_sums.append(sq_sum)
        self._weights.append(float(weight))
        if unmeasured_sq is not None:
            self._add_example_blocks(sq_sum + unmeasured_sq, int(unit_count), micro_size, float(weight))
        self.unit_size_sum += unit_size_sum
        self.unit_count += unit_count
        self.micro_count += 1
        self.micro_inv_size_sum += 1.0 / micro_size
        self.micro_size_sum += micro_size

    def _add_example_blocks(self, excluded_sq: torch.Tensor, measured: int, micro_size: int, weight: float) -> None:
        """Record ``D_j + R_j`` and its ``k_j + (b_j − k_j)²`` terms, weighted for a mean (``/b_j²``) and a sum."""
        terms = measured + (micro_size - measured) ** 2
        self._excluded_sqs.append(torch.as_tensor(excluded_sq))
        self._excluded_weights.append((weight / micro_size**2, weight))
        self.excluded_terms_over_b2 += terms / micro_size**2
        self.excluded_terms += terms

    @property
    def empty(self) -> bool:
        return not self._sq_sums

    def measurable(self, loss_reduction: LossReduction = "mean") -> bool:
        """Whether the small and big effective batch sizes differ (known on the host for one process)."""
        if self.empty:
            return False
        b_small = self.unit_size_sum / self.unit_count
        b_big = self.micro_count**2 / self.micro_inv_size_sum if loss_reduction == "mean" else self.micro_size_sum
        return b_big > b_small * (1.0 + 1e-9)

    def packed(
        self, device: torch.device | str | None = None, loss_scale: torch.Tensor | float | None = None
    ) -> torch.Tensor:
        """The sums as one float64 tensor in ``PACKED_FIELDS`` order, summable across ranks (an empty window
        packs zeros, so that a rank with nothing to report still joins the all-reduce).

        ``loss_scale``: the AMP GradScaler's scale the backward passes ran with; the small-batch norms are
        divided by its square (the optimizer's ``.grad`` is unscaled by then)."""
        host, terms = self._host_sums()
        if not self._sq_sums:
            return torch.tensor([0.0, *host, 0.0, 0.0, *terms], dtype=torch.float64, device=device)
        sq = torch.stack(self._sq_sums).to(torch.float64)
        device = sq.device if device is None else device
        weights = torch.tensor(self._weights, dtype=torch.float64).to(sq.device, non_blocking=True)
        values = torch.tensor(host, dtype=torch.float64).to(sq.device, non_blocking=True)
        squares = torch.cat([(sq @ weights).reshape(1), self._excluded_packed(sq.device)])
        if loss_scale is not None:
            squares = squares / torch.as_tensor(loss_scale, dtype=torch.float64, device=sq.device) ** 2
        extra = torch.tensor(terms, dtype=torch.float64).to(sq.device, non_blocking=True)
        return torch.cat([squares[:1], values, squares[1:], extra]).to(device)

    def device_squares(self) -> list[torch.Tensor]:
        """The window's device scalars (each micro-batch's ``sq_sum``, then each ``D_j + R_j``): what
        :meth:`packed_values` reads, to be copied to the host in one go."""
        return [*self._sq_sums, *self._excluded_sqs]

    def packed_values(self, loss_scale: torch.Tensor | float | None = None,
                      squares: Optional[Sequence[float]] = None) -> list[float]:
        """:meth:`packed` as host floats: the same sums (bit for bit with one backward pass; a sum over several may
        round differently, by an ulp), without a tensor operation per field. ``squares``: the values of
        :meth:`device_squares`, already on the host (default: read now, free for CPU tensors)."""
        host, terms = self._host_sums()
        if squares is None:
            squares = [float(v) for v in self.device_squares()]
        sq_sums, excluded = list(squares[: len(self._sq_sums)]), list(squares[len(self._sq_sums):])
        squares = [_dot(sq_sums, self._weights)]
        squares += [_dot(excluded, [w for w, _ in self._excluded_weights]),
                    _dot(excluded, [w for _, w in self._excluded_weights])]
        if loss_scale is not None and self._sq_sums:
            scale = float(loss_scale)
            squares = [v / (scale * scale) for v in squares]
        return [squares[0], *host, *squares[1:], *terms]

    def _host_sums(self) -> tuple[list[float], list[float]]:
        """The fields known on the host: those between the first square and the excluded squares, and the last
        two (``PACKED_FIELDS`` order)."""
        host = [self.unit_size_sum, self.unit_count, float(self.micro_count), self.micro_inv_size_sum,
                self.micro_size_sum, 1.0, self.loss_divisor, float(len(self._excluded_sqs))]
        return host, [self.excluded_terms_over_b2, self.excluded_terms]

    def _excluded_packed(self, device: torch.device) -> torch.Tensor:
        """``(Σ_j weight_j·(D_j + R_j)/b_j², Σ_j weight_j·(D_j + R_j))`` on ``device`` (zeros without example units)."""
        if not self._excluded_sqs:
            return torch.zeros(2, dtype=torch.float64, device=device)
        excluded = torch.stack([v.to(device) for v in self._excluded_sqs]).to(torch.float64)
        weights = torch.tensor(self._excluded_weights, dtype=torch.float64).to(device, non_blocking=True)
        return excluded @ weights


def _dot(values: Sequence[float], weights: Sequence[float]) -> float:
    """``Σ v·w`` in order (0 for none)."""
    total = 0.0
    for v, w in zip(values, weights):
        total += v * w
    return total


#: How far the step's mean-gradient norm may exceed the mean of its units' before the two read as on different
#: scales (exactly 1 by Jensen's inequality; the margin covers sketched norms' noise, :mod:`.per_example.sketch`).
SCALE_MARGIN = 10.0


def scale_mismatch(packed: Sequence[float], step_grad_sq: float, loss_reduction: LossReduction = "mean") -> float:
    """``|Ĝ_B|² / mean_j |ĝ_j|²`` of one step (host floats, ``PACKED_FIELDS``) where its units (examples or
    micro-batches) cover every example, else 0. The mean gradient's squared norm never exceeds the mean of its
    parts' (Jensen), so a ratio above :data:`SCALE_MARGIN` means the two were read on different scales: an AMP loss
    scale taken off one and not the other, say."""
    unit_sq_sum, unit_size_sum, _, micro_count, _, micro_size_sum, _, divisor_sum = packed[:8]
    if unit_size_sum < micro_size_sum or unit_sq_sum <= 0.0:
        return 0.0
    grad_to_mean = _grad_to_mean(divisor_sum, micro_count, micro_size_sum, loss_reduction)
    return step_grad_sq * grad_to_mean * grad_to_mean / (unit_sq_sum / unit_size_sum)


def _grad_to_mean(divisor_sum: Any, micro_count: Any, micro_size_sum: Any, loss_reduction: LossReduction) -> Any:
    """What turns the optimizer's gradient into the big batch's mean gradient (:func:`step_estimates`)."""
    return divisor_sum / (micro_count if loss_reduction == "mean" else micro_size_sum)


def step_estimates(
    packed: Union[torch.Tensor, Sequence[float]],
    step_grad_sq: Union[torch.Tensor, float],
    loss_reduction: LossReduction = "mean",
    blend: Optional[PairBlend] = None,
) -> tuple[Any, Any, Any]:
    """One step's unbiased ``(tr(Σ), |G|², valid)`` from globally summed window sums.

    Args:
        packed: window sums (``PACKED_FIELDS``), summed over ranks, small-batch norms already unscaled: a float64
            tensor (:meth:`AccumulationWindow.packed`; the results are 0-d tensors on its device, no host sync), or
            host floats (:meth:`AccumulationWindow.packed_values`; the results are NumPy ``float64`` scalars and a
            ``bool``, the same arithmetic, :mod:`gns_callback.scalar_ops`).
        step_grad_sq: ``|g|²`` of the gradient the optimizer sees (``p.grad``, unscaled, data-parallel averaged).
        loss_reduction: ``"mean"`` (Lightning's convention) or ``"sum"``; sets the big batch's effective size.
        blend: where a subset of the examples was measured, ``|G|²`` is this blend of the pair estimate and the
            two-batch-size one (:mod:`gns_callback.blend`; it keeps its moments); None: the pair estimate alone.

    The optimizer's gradient is ``g = (1/R)·Σ_ranks (1/d)·Σ_passes ĝ``: the average over ``R`` ranks of the
    summed backward passes, each of whose loss was divided by ``d``. The big-batch mean gradient is ``c·g`` with
    ``c = R·d/n`` (mean loss; ``n`` micro-batches in all) or ``R·d/N`` (sum loss; ``N`` examples): this undoes
    Lightning's ``1/accumulate_grad_batches`` over a partial window and DDP's ``1/world_size``.

    ``valid`` is False when a value is not finite (e.g. a step the GradScaler skips) or the two batch sizes
    coincide (one micro-batch on one device: nothing to compare).
    """
    if isinstance(packed, torch.Tensor):
        return _step_estimates(packed.unbind(), step_grad_sq.to(torch.float64), loss_reduction, blend, TORCH)
    with host_errors_ignored():
        values = [np.float64(v) for v in packed]
        return _step_estimates(values, np.float64(step_grad_sq), loss_reduction, blend, HOST)


def _step_estimates(packed: Sequence[Any], step_grad_sq: Any, loss_reduction: LossReduction,
                    blend: Optional[PairBlend], ops: ScalarOps) -> tuple[Any, Any, Any]:
    """:func:`step_estimates` on the unpacked fields, with ``ops`` for the tensors' or the host's scalars."""
    (unit_sq_sum, unit_size_sum, unit_count, micro_count, micro_inv_size_sum, micro_size_sum, _, divisor_sum,
     example_micro_count, excluded_sq_over_b2, excluded_sq, excluded_terms_over_b2, excluded_terms) = packed
    grad_to_mean = _grad_to_mean(divisor_sum, micro_count, micro_size_sum, loss_reduction)
    small_sq = unit_sq_sum / unit_size_sum
    b_small = unit_size_sum / unit_count
    if loss_reduction == "mean":
        b_big = micro_count * micro_count / micro_inv_size_sum
    else:
        b_big = micro_size_sum
    big_sq = step_grad_sq * (grad_to_mean * grad_to_mean)
    trace = trace_sigma_estimate(small_sq, big_sq, b_small, b_big)
    grad_sq = grad_sq_norm_estimate(small_sq, big_sq, b_small, b_big)
    valid = b_big > b_small * (1.0 + 1e-9)
    if loss_reduction == "mean":  # w_j = 1/(n·b_j): Σ w_j²·v_j = Σ (v_j/b_j²)/n²
        n2 = micro_count * micro_count
        excluded_sq, excluded_terms = excluded_sq_over_b2 / n2, excluded_terms_over_b2 / n2
    else:  # w_j = 1/N
        n2 = micro_size_sum * micro_size_sum
        excluded_sq, excluded_terms = excluded_sq / n2, excluded_terms / n2
    pairs = (example_micro_count == micro_count) & (micro_count > 0)
    pair_grad_sq = (big_sq - excluded_sq) / (1.0 - excluded_terms)
    pair_valid = excluded_terms < 1.0 - 1e-9
    if blend is not None:
        subset = pairs & (unit_count < micro_size_sum) & pair_valid & ops.isfinite(grad_sq)
        pair_grad_sq = blend.blend(small_sq, pair_grad_sq, grad_sq, subset)
    grad_sq = ops.where(pairs, pair_grad_sq, grad_sq)
    trace = ops.where(pairs, (small_sq - pair_grad_sq) * b_small, trace)
    valid = ops.where(pairs, pair_valid, valid)
    return trace, grad_sq, valid & ops.isfinite(trace) & ops.isfinite(grad_sq)
