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
Before ``MIN_STEPS`` steps, ``λ = 1/2``. All on the device: no host synchronisation.
"""

from __future__ import annotations

import torch

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
        n, zp, zt, zpp, ztt, zpt, _, _ = self.sums.unbind()
        count = n.clamp_min(1.0)
        vp, vt = zpp / count - (zp / count) ** 2, ztt / count - (zt / count) ** 2
        cov = zpt / count - zp * zt / count**2
        denominator = vp + vt - 2.0 * cov
        lam = ((vt - cov) / denominator.clamp_min(1e-300)).clamp(0.0, 1.0)
        return torch.where((n >= MIN_STEPS) & (denominator > 0), lam, torch.full_like(lam, 0.5))

    def blend(self, mean_sq: torch.Tensor, y_pairs: torch.Tensor, y_two: torch.Tensor,
              use: torch.Tensor) -> torch.Tensor:
        """This step's ``|G|²``: the blend where ``use`` (a subset was measured and the step is valid), else
        ``y_pairs``; the step then joins the moments."""
        self._to(mean_sq.device)
        mean_sq, y_pairs, y_two = (v.to(torch.float64) for v in (mean_sq, y_pairs, y_two))
        lam = self.weight()
        blended = lam * y_pairs + (1.0 - lam) * y_two
        x_sum, y_sum = self.sums[6] + (mean_sq - blended), self.sums[7] + blended
        c = 1.0 + torch.where(y_sum > 0, x_sum / y_sum.clamp_min(1e-300), torch.zeros_like(y_sum)).clamp_min(0.0)
        zp, zt = mean_sq - c * y_pairs, mean_sq - c * y_two
        step = torch.stack([torch.ones_like(zp), zp, zt, zp * zp, zt * zt, zp * zt, mean_sq - blended, blended])
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


__all__ = ["PairBlend", "MIN_STEPS", "FIELDS"]
