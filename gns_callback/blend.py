"""Blending the two unbiased ``|G|²`` estimates of a step that measured a subset of its examples (torch only).

With ``k`` of ``b`` examples measured, two unbiased estimates of ``|G|²`` come from the same step
(:mod:`gns_callback.accumulation`): ``y_pairs``, from every pair of distinct examples that involves a measured one,
and ``y_two``, the two-batch-size difference ``(B·|G_B|² − b·m)/(B − b)`` (``m``: the measured examples' mean square,
``b = 1``). Which is less noisy depends on the model: ``y_two`` carries the subset's sampling error of ``m``
(large when per-example norms are heavy-tailed), ``y_pairs`` leaves out the pairs of unmeasured examples (a loss
when they carry most of the information). On scikit-learn data at batch 64 with 16 measured, each was the better
one on some model, by up to 2×.

Any fixed weight ``λ`` keeps ``y = λ·y_pairs + (1 − λ)·y_two`` unbiased. The ratio ``B_simple = tr Σ/|G|²`` with
``tr Σ = m − y`` has, to first order, the error of ``z = m − (1 + R)·y`` (``R`` the current ratio), so ``λ`` is
chosen to minimise ``Var z``:

    λ = (V_two − C) / (V_pairs + V_two − 2C),   clipped to [0, 1],

with the variances and covariance of ``z_pairs``, ``z_two`` over the *earlier* steps (inverse-variance weighting of
two correlated unbiased estimators; the weight depends on the past only, so each step stays unbiased given it).
Before ``MIN_STEPS`` steps, ``λ = 1/2``. All on the device (no host synchronisation), or on host scalars where the
step's values are on the CPU (:mod:`gns_callback.scalar_ops`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch

from gns_callback.scalar_ops import HOST, TORCH, ScalarOps

#: Steps before the weights are estimated (an even blend until then).
MIN_STEPS = 10
#: Order of :attr:`PairBlend.sums`: count, Σz_pairs, Σz_two, Σz_pairs², Σz_two², Σz_pairs·z_two, Σ(m − y), Σy.
FIELDS = ("n", "zp", "zt", "zpp", "ztt", "zpt", "x", "y")


class PairBlend:
    """Running moments of the two estimates' ratio errors, and the blend they imply (module docstring)."""

    def __init__(self) -> None:
        self.sums = torch.zeros(len(FIELDS), dtype=torch.float64)

    def weight(self) -> torch.Tensor:
        """``λ`` from the steps so far (``1/2`` before :data:`MIN_STEPS`)."""
        return blend_weight(self.sums.unbind(), TORCH)

    def blend(self, mean_sq: Any, y_pairs: Any, y_two: Any, use: Any) -> Any:
        """This step's ``|G|²``: the blend where ``use`` (a subset was measured and the step is valid), else
        ``y_pairs``; the step then joins the moments.

        0-d tensors (kept on their device, no host sync), or NumPy ``float64`` scalars and a ``bool`` on the host
        (the sums move to the CPU; :mod:`gns_callback.scalar_ops`): the same numbers to the bit."""
        if isinstance(mean_sq, torch.Tensor):
            return self._blend_tensors(mean_sq, y_pairs, y_two, use)
        self._to(torch.device("cpu"))
        sums = self.sums.numpy()
        blended, step = blend_step(list(sums), mean_sq, y_pairs, y_two, HOST)
        if use and all(math.isfinite(v) for v in step):
            self.sums = torch.from_numpy(sums + np.array(step, dtype=np.float64))
        return blended if use else y_pairs

    def _blend_tensors(self, mean_sq: torch.Tensor, y_pairs: torch.Tensor, y_two: torch.Tensor,
                       use: torch.Tensor) -> torch.Tensor:
        self._to(mean_sq.device)
        mean_sq, y_pairs, y_two = (v.to(torch.float64) for v in (mean_sq, y_pairs, y_two))
        blended, parts = blend_step(self.sums.unbind(), mean_sq, y_pairs, y_two, TORCH)
        step = torch.stack([torch.ones_like(parts[1]), *parts[1:]])
        ok = use & torch.isfinite(step).all()
        self.sums = self.sums + torch.where(ok, step, torch.zeros_like(step))
        return torch.where(use, blended, y_pairs)

    def state_dict(self) -> dict:
        return {"sums": self.sums.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.sums = torch.tensor(state["sums"], dtype=torch.float64, device=self.sums.device)

    def _to(self, device: torch.device) -> None:
        if self.sums.device != device:
            self.sums = self.sums.to(device)


def blend_weight(sums: Sequence[Any], ops: ScalarOps) -> Any:
    """``λ`` from the moments ``sums`` (``FIELDS`` order; ``1/2`` before :data:`MIN_STEPS`)."""
    n, zp, zt, zpp, ztt, zpt, _, _ = sums
    count = ops.clamp_min(n, 1.0)
    mean_p, mean_t = zp / count, zt / count
    vp, vt = zpp / count - mean_p * mean_p, ztt / count - mean_t * mean_t
    cov = zpt / count - zp * zt / (count * count)
    denominator = vp + vt - 2.0 * cov
    lam = ops.clamp((vt - cov) / ops.clamp_min(denominator, 1e-300), 0.0, 1.0)
    return ops.where((n >= MIN_STEPS) & (denominator > 0), lam, 0.5)


def blend_step(sums: Sequence[Any], mean_sq: Any, y_pairs: Any, y_two: Any, ops: ScalarOps) -> tuple[Any, list[Any]]:
    """``(blended, step)``: the blend at the weight the moments ``sums`` give, and this step's contribution to
    them (``FIELDS`` order) should it join."""
    lam = blend_weight(sums, ops)
    blended = lam * y_pairs + (1.0 - lam) * y_two
    x_sum, y_sum = sums[6] + (mean_sq - blended), sums[7] + blended
    c = 1.0 + ops.clamp_min(ops.where(y_sum > 0, x_sum / ops.clamp_min(y_sum, 1e-300), 0.0), 0.0)
    zp, zt = mean_sq - c * y_pairs, mean_sq - c * y_two
    return blended, [1.0, zp, zt, zp * zp, zt * zt, zp * zt, mean_sq - blended, blended]


__all__ = ["PairBlend", "MIN_STEPS", "FIELDS", "blend_weight", "blend_step"]
