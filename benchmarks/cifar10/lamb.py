"""LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes",
Algorithm 2): ``timm.optim.Lamb`` when ``timm`` imports, else :class:`Lamb` below.

For each parameter tensor ``x`` (one "layer") at step ``t`` with gradient ``g``:

    m = β1·m + (1 − β1)·g                 v = β2·v + (1 − β2)·g²
    m̂ = m / (1 − β1^t)                   v̂ = v / (1 − β2^t)           (bias correction)
    r = m̂ / (√v̂ + ε)
    u = r + λ·x                           (weight decay added to the update, decoupled from the moments)
    x ← x − η · φ(‖x‖)/‖u‖ · u           (trust ratio; 1 when ‖x‖ or ‖u‖ is 0; φ = identity)

``timm``'s implementation is NVIDIA's (FusedLAMB): it also clips the global gradient norm to 1 by default and
skips the trust ratio on parameters without weight decay. :func:`build_lamb` turns both off
(``max_grad_norm=inf``, ``always_adapt=True``) so that the two implementations compute the same update: the
paper's. Biases and BatchNorm parameters get no weight decay (standard practice; the paper excludes them too).
"""

from __future__ import annotations

import inspect
import math
from typing import Iterable, Optional

import torch
from torch import nn


class Lamb(torch.optim.Optimizer):
    """LAMB as in You et al. 2019, Algorithm 2 (see the module docstring for the update).

    Args:
        params: parameters or parameter groups.
        lr: learning rate ``η``.
        betas: ``(β1, β2)``.
        eps: ``ε`` added to ``√v̂`` (the paper uses 1e-6).
        weight_decay: ``λ``, added to the update (not to the gradient) before the trust ratio.
        bias_correction: divide the moments by ``1 − β^t``.
        max_trust_ratio: clip the trust ratio from above (``None``: no clipping, as in the paper).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        max_trust_ratio: Optional[float] = None,
    ) -> None:
        if lr < 0.0:
            raise ValueError(f"Lamb(lr={lr}): must be ≥ 0")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb(betas={betas}): each in [0, 1)")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError("Lamb: eps and weight_decay must be ≥ 0")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("Lamb does not support sparse gradients")
            beta1, beta2 = group["betas"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
            # One step count per group (parameters of a group are stepped together).
            t = self.state[params[0]]["step"]
            grads = [p.grad for p in params]
            m = [self.state[p]["exp_avg"] for p in params]
            v = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_mul_(m, beta1)
            torch._foreach_add_(m, grads, alpha=1.0 - beta1)
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, value=1.0 - beta2)
            bc1 = 1.0 - beta1**t if group["bias_correction"] else 1.0
            bc2 = 1.0 - beta2**t if group["bias_correction"] else 1.0
            # r = m̂ / (√v̂ + ε) with m̂ = m / bc1, v̂ = v / bc2
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, bc2**0.5)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(m, denom)
            torch._foreach_div_(update, bc1)
            if group["weight_decay"] != 0.0:
                torch._foreach_add_(update, params, alpha=group["weight_decay"])
            w_norm = torch.stack(torch._foreach_norm(params))
            u_norm = torch.stack(torch._foreach_norm(update))
            ratio = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            if group["max_trust_ratio"] is not None:
                ratio = ratio.clamp(max=group["max_trust_ratio"])
            ratio = ratio * -group["lr"]
            torch._foreach_mul_(update, list(ratio.to(update[0].dtype).unbind()))
            torch._foreach_add_(params, update)
        return loss


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on conv/linear weights only (tensors with ≥ 2 dimensions); none on biases and BatchNorm."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_lamb(
    model: nn.Module, lr: float, *, weight_decay: float = 0.01, impl: str = "auto"
) -> tuple[torch.optim.Optimizer, str]:
    """``(optimizer, description)``: ``timm.optim.Lamb`` (``impl="timm"``, or ``"auto"`` when ``timm`` imports)
    configured as the paper's LAMB, else the built-in :class:`Lamb`."""
    if impl not in ("auto", "timm", "builtin"):
        raise ValueError(f"impl={impl!r}: 'auto', 'timm' or 'builtin'")
    groups = param_groups(model, weight_decay)
    if impl in ("auto", "timm"):
        try:
            from timm.optim import Lamb as TimmLamb
        except Exception:
            if impl == "timm":
                raise
        else:
            accepted = inspect.signature(TimmLamb).parameters
            # max_grad_norm=inf: no global clipping (None breaks older timm releases, which build a tensor from it)
            options = {"betas": (0.9, 0.999), "eps": 1e-6, "bias_correction": True, "max_grad_norm": math.inf,
                       "always_adapt": True, "trust_clip": False}
            options = {k: v for k, v in options.items() if k in accepted}
            return TimmLamb(groups, lr=lr, **options), "timm.optim.Lamb (no global grad clipping, always_adapt=True)"
    return Lamb(groups, lr=lr, betas=(0.9, 0.999), eps=1e-6), "built-in Lamb (You et al. 2019, Alg. 2)"
