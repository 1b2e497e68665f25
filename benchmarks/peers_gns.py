"""Three public gradient-noise-scale estimators, re-implemented for the benchmarks (never part of the package).

Each class follows one file of a public repository, line by line where it matters for the number it reports, and
is fed the per-step quantities that file reads off a real training step. They all estimate the simple noise scale
``B_simple = tr Σ/|G|²`` (McCandlish et al. 2018) from squared gradient norms at two batch sizes, with the unbiased
pair of App. A.1 (:mod:`gns_callback.estimators` writes the same formulas), and smooth ``tr Σ̂`` and ``|Ĝ|²``
separately with an exponential moving average before taking the ratio. None of them reports an interval.

* :class:`NanoGNS` — CerebrasResearch/nanoGNS, commit ``b3b0c9c1699716b666e534782af2dfbc3cba672b``:
  ``exact/gnstracking.py`` (``MeasurementTracker.step`` logs ``|∇L_B|`` and the per-example norm
  ``sqrt(prod(buffer)) = sqrt(mean_i |g_i|²)`` that the ``exact/buffered.py`` layers accumulate) and
  ``exact/gns-analysis.py`` (``unbiased_stats`` with ``B_small = 1``; ``compute_ema``: pandas
  ``ewm(alpha=1 − 0.99, adjust=False)`` at the script's default ``--alpha 0.99``; ``gns = trsigma_ema /
  gtg_ema.clip(lower=1e-6)``).
* :class:`GptNeoxGNS` — EleutherAI/gpt-neox, commit ``ea7aefd8f8e183256992d9fede4d7c71a46d67a5``:
  ``megatron/gradient_noise_scale/gradient_noise_scale.py`` (``GradientNoiseScale._update``, ``ema``), constructed
  in ``megatron/utils.py`` with ``batch_size_small = train_batch_size`` and ``n_batches =
  gradient_noise_scale_n_batches`` (default 5, ``megatron/neox_arguments/neox_args.py``), ``beta = 0.99``: it sums
  the step gradients of ``n_batches`` consecutive steps; at every ``n_batches``-th step ``|G_big|²`` is the squared
  norm of their mean (``B_big = 5·B``) and ``|G_small|²`` the squared norm of that step's own gradient (``B_small =
  B``), one estimate per 5 steps.
* :class:`AdaptDLGNS` — petuum/adaptdl, commit ``542e123e50e98e4a7a7132d36c4af06c9437f6e4``:
  ``adaptdl/adaptdl/torch/gradient_noise_scale.py`` (``GradientNoiseScale._final_callback``) with one process and no
  accumulation (``num_replicas = 1``, ``accum_scale = 1``, ``accum_count = 1``, as ``adaptdl/torch/parallel.py``
  constructs it): "single gradient datapoint, use difference estimation", pairing each step's gradient with the
  previous step's, smoothing ``θ = 0.999**scale`` with ``scale = 2``, bias-corrected; ``sqr_avg()`` clamps at 0 and
  ``var_avg()`` at 1e-6. ``var_avg`` is the variance of one gradient at the initial batch size (``goodput.py``'s
  gain ``(var + sqr)/(var/scale + sqr)`` with ``scale = batch/init_batch``), so ``B_simple = B·var_avg/sqr_avg``.

Deviations, the same for all three: the inputs are computed in float64 from the exact per-example gradient matrix at
fixed parameters (the step's gradient is the mean of its examples' rows, the per-example squared norms their rows'
squared norms), which is what each peer reads off a real step of a model without cross-example coupling, up to float32
rounding; nothing of the peers' distributed, mixed-precision or overflow handling is reproduced (one process, fp32,
no overflow). nanoGNS ships per-example layers for ``Linear``, ``Embedding`` and ``LayerNorm`` only: on a model with
``Conv2d``/``GroupNorm`` it is given the exact per-example norms of every parameter, what such layers would compute.
AdaptDL's Adam preconditioning is not used (plain SGD: its preconditioner is 1).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

NANOGNS_COMMIT = "b3b0c9c1699716b666e534782af2dfbc3cba672b"
GPT_NEOX_COMMIT = "ea7aefd8f8e183256992d9fede4d7c71a46d67a5"
ADAPTDL_COMMIT = "542e123e50e98e4a7a7132d36c4af06c9437f6e4"


class NanoGNS:
    """nanoGNS's exact per-example estimator: per step ``|G_B|²`` of the batch gradient and the mean per-example
    squared norm ``mean_i |g_i|²`` (B_small = 1), unbiased pair, pandas ``ewm(adjust=False)`` of each part.

    ``gtg = (B·sgn − spegn)/(B − 1)``, ``trsigma = (spegn − sgn)/(1 − 1/B)`` (``unbiased_stats``);
    ``ema_0 = x_0``, ``ema_t = α·ema_{t−1} + (1 − α)·x_t`` with ``α = 0.99``; ``gns = trsigma_ema/max(gtg_ema, 1e-6)``.
    """

    def __init__(self, alpha: float = 0.99) -> None:
        self.alpha = alpha
        self.gtg_ema: Optional[float] = None
        self.trsigma_ema: Optional[float] = None

    def update(self, batch_grad: torch.Tensor, per_example_sq_norms: torch.Tensor) -> None:
        """``batch_grad``: the step's (mean-loss) gradient, flattened; ``per_example_sq_norms``: ``|g_i|²`` of each
        example's own loss gradient (what ``prod(buffer)`` turns the layers' sums into: their mean)."""
        b = per_example_sq_norms.numel()
        sgn = float(batch_grad.pow(2).sum())
        spegn = float(per_example_sq_norms.mean())
        gtg = (b * sgn - spegn) / (b - 1.0)
        trsigma = (spegn - sgn) / (1.0 - 1.0 / b)
        self.gtg_ema = gtg if self.gtg_ema is None else self.alpha * self.gtg_ema + (1 - self.alpha) * gtg
        self.trsigma_ema = trsigma if self.trsigma_ema is None else (
            self.alpha * self.trsigma_ema + (1 - self.alpha) * trsigma)

    @property
    def value(self) -> float:
        if self.gtg_ema is None:
            return math.nan
        return self.trsigma_ema / max(self.gtg_ema, 1e-6)


def _neox_ema(avg: Optional[float], beta: float, yi: float, i: int) -> tuple[float, float]:
    """gpt-neox's ``ema``: the running sum and its bias-corrected value (``i`` is its step counter, not the
    number of updates: the correction is the same for both parts, so the ratio does not see it)."""
    avg = beta * (avg or 0.0) + (1 - beta) * yi
    return avg, avg / (1 - beta ** (i + 1))


class GptNeoxGNS:
    """gpt-neox's ``GradientNoiseScale``: consecutive steps as the big batch, one estimate per ``n_batches`` steps.

    Every step adds its gradient to a buffer; at steps ``n_updates ≡ n_batches − 1 (mod n_batches)`` the buffer's
    mean ``G_big`` (``B_big = n_batches·B``) and that step's gradient ``G_small`` (``B_small = B``) give
    ``noise = (B_big|G_big|² − B_small|G_small|²)/(B_big − B_small)`` (the ``|G|²`` estimate) and
    ``scale = (|G_small|² − |G_big|²)/(1/B_small − 1/B_big)`` (the ``tr Σ`` estimate), each smoothed by ``ema``;
    ``noise_scale = scale/noise``.
    """

    def __init__(self, batch_size_small: int, n_batches: int = 5, beta: float = 0.99) -> None:
        self.batch_size_small = batch_size_small
        self.batch_size_large = batch_size_small * n_batches
        self.n_batches = n_batches
        self.beta = beta
        self.buffer: Optional[torch.Tensor] = None
        self.ema_noise: Optional[float] = None
        self.ema_scale: Optional[float] = None
        self.noise_scale = math.nan
        self.n_updates = 0

    def update(self, batch_grad: torch.Tensor) -> None:
        grad = batch_grad.reshape(-1)
        self.buffer = grad.clone() if self.buffer is None else self.buffer + grad
        if self.n_updates % self.n_batches == self.n_batches - 1:
            grads, self.buffer = self.buffer / self.n_batches, None
            g_big = float(grads.pow(2).sum())
            g_small = float(grad.pow(2).sum())
            small, large = self.batch_size_small, self.batch_size_large
            noise = (large * g_big - small * g_small) / (large - small)
            scale = (g_small - g_big) / (1 / small - 1 / large)
            self.ema_noise, noise = _neox_ema(self.ema_noise, self.beta, noise, self.n_updates)
            self.ema_scale, scale = _neox_ema(self.ema_scale, self.beta, scale, self.n_updates)
            self.noise_scale = scale / noise
        self.n_updates += 1

    @property
    def value(self) -> float:
        return self.noise_scale


class AdaptDLGNS:
    """AdaptDL's ``GradientNoiseScale`` with one process and no accumulation: step differencing.

    From the second step on, with the previous step's gradient ``g'``: ``local_sqr = (|g'|² + |g|²)/2``,
    ``total_sqr = |(g + g')/2|²``, ``count = 2``, ``scale = 2``; ``grad_sqr = (count·total − local)/(count − 1)``,
    ``grad_var = (local − total)·scale/(count − 1)``, each averaged with ``θ = smoothing**scale`` and the bias
    correction ``_update_avg``. The noise scale at the batch size ``B`` it ran with: ``B·var_avg()/sqr_avg()``.
    """

    def __init__(self, batch_size: int, smoothing: float = 0.999) -> None:
        self.batch_size = batch_size
        self.smoothing = smoothing
        self.state = {"sqr_avg": 1.0, "var_avg": 0.0}  # AdaptDL's initial state
        self.prev_grad: Optional[torch.Tensor] = None

    def update(self, batch_grad: torch.Tensor) -> None:
        grad = batch_grad.reshape(-1)
        grads_normsqr = float(grad.pow(2).sum())
        if self.prev_grad is not None:
            local_sqr = (float(self.prev_grad.pow(2).sum()) + grads_normsqr) / 2
            total_sqr = float(((grad + self.prev_grad) / 2).pow(2).sum())
            count, scale = 2, 2
            grad_sqr = (count * total_sqr - local_sqr) / (count - 1)
            grad_var = (local_sqr - total_sqr) * scale / (count - 1)
            theta = self.smoothing ** scale
            self._update_avg("sqr_avg", grad_sqr, theta)
            self._update_avg("var_avg", grad_var, theta)
        self.prev_grad = grad.clone()

    def _update_avg(self, name: str, value: float, factor: float) -> None:
        biased = factor * self.state.get(name + "_biased", 0.0) + (1.0 - factor) * value
        unbias = factor * self.state.get(name + "_unbias", 0.0) + (1.0 - factor)
        self.state[name + "_biased"], self.state[name + "_unbias"] = biased, unbias
        self.state[name] = biased / unbias

    def sqr_avg(self) -> float:
        return max(self.state["sqr_avg"], 0.0)

    def var_avg(self) -> float:
        return max(self.state["var_avg"], 1e-6)

    @property
    def value(self) -> float:
        if self.prev_grad is None or "sqr_avg_unbias" not in self.state:
            return math.nan
        sqr = self.sqr_avg()
        return self.batch_size * self.var_avg() / sqr if sqr > 0 else math.inf


__all__ = ["AdaptDLGNS", "GptNeoxGNS", "NanoGNS", "ADAPTDL_COMMIT", "GPT_NEOX_COMMIT", "NANOGNS_COMMIT"]
