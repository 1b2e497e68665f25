"""The sharpness ``λ_max`` measured during a fit, on a few early steps, without touching the user's run.

``recommend(sharpness=...)`` raises an SGD learning rate on a batch increase only up to the stability limit
``2(1+β)/λ_max`` (:mod:`gns_callback.recommendation.stability`), and only the *largest* ``λ_max`` along the run
makes that limit safe: on digits it peaks within the first sixth of each run, then falls (benchmarks/RESULTS.md,
"Learning-rate transfer on digits"). :class:`SharpnessMonitor` therefore measures it at the start of a few
optimizer steps on a geometric schedule (global steps 4, 8, 16, ..., 1024 by default), on that step's batch
(its first micro-batch), and keeps the largest value.

Each measurement is a Lanczos iteration on Hessian-vector products
(:func:`gns_callback.curvature.lanczos_top_eigenvalue`; products as in Pearlmutter 1994), stopped when the top
Ritz residual is below ``rtol·λ`` or after ``max_iterations`` products (default 30). Lanczos rather than power
iteration, and a fresh random start rather than the previous eigenvector: on the digits MLP, 20 power
iterations were still 1–13% low at some steps, warm-started ones too (the top eigenvector turns between
measurements), while Lanczos reached the converged value in 7–12 products past initialisation (30 at
initialisation, where the spectrum is crowded); see benchmarks/RESULTS.md, "Sharpness during a fit". It runs ``training_step`` outside autocast (double backward in fp16 underflows), with
``self.log`` silenced, SyncBatchNorm local, and everything the step touches put back afterwards
(:func:`gns_callback.probe.state.preserved_state`: weights, ``.grad``, optimizer state, BatchNorm running
statistics, RNG states, module attributes and torchmetrics states). The passes use ``torch.autograd.grad`` with
``create_graph=True``: the meter's per-example hooks would refuse such a pass (it looks like a gradient
penalty), so the caller passes ``quiet`` (the meter's ``paused``) and measurements happen only at the first
micro-batch of an accumulation window, where the meter holds nothing yet.

Only for SGD-family optimizers (an adaptive optimizer's stability limit is on the preconditioned Hessian, which
this does not measure) and automatic optimization (a manual ``training_step`` steps the optimizer itself).
Under DDP each rank measures its own batch and the ranks take the maximum through the strategy's reduce (one
2-element all-reduce per measurement, reached by every rank also when its own measurement failed). A failure on
any rank warns once and stops measuring: ``largest`` becomes ``None`` (a maximum over fewer steps could miss the
peak, and an underestimate of ``λ_max`` would allow too large a learning rate).
"""

from __future__ import annotations

import math
import warnings
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable, Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from gns_callback.curvature import hessian_vector_product_fn, lanczos_top_eigenvalue
from gns_callback.probe.lightning import aside_from_the_run, lightning_step
from gns_callback.recommendation.rules import SGD_RULES, check_rule, lr_rule_for

#: Global steps (optimizer steps taken) at which ``λ_max`` is measured by default: doublings from 4 to 1024.
DEFAULT_STEPS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)
STATE_VERSION = 1
Quiet = Callable[[], AbstractContextManager[Any]]


def _check_steps(steps: Sequence[int]) -> tuple[int, ...]:
    steps = tuple(steps)
    if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in steps):
        raise ValueError(
            f"SharpnessMonitor(steps={steps!r}): a non-empty sequence of global steps (ints ≥ 0), e.g. "
            f"{DEFAULT_STEPS}."
        )
    return tuple(sorted(set(steps)))


class SharpnessMonitor:
    """The largest ``λ_max`` (top Hessian eigenvalue of the training loss) over a few early optimizer steps.

    Call :meth:`on_train_batch_start` from the callback's hook of the same name (one line); read
    :attr:`largest` (``None`` until measured, and for Adam-family optimizers, manual optimization, or after a
    failure).

    Args:
        steps: the global steps at which to measure (at the start of that step, on its first micro-batch; a step
            skipped, e.g. by a resume, is measured at the next window start).
        max_iterations, rtol: budget and stopping tolerance (on the Ritz residual, relative) of each Lanczos
            iteration (one Hessian-vector product per iteration, about two backward passes).
        lr_rule: the LR rule the recommendation uses; ``None``: by optimizer family
            (:func:`~gns_callback.recommendation.rules.lr_rule_for`). Measures only for the SGD rules.
    """

    def __init__(
        self,
        steps: Sequence[int] = DEFAULT_STEPS,
        *,
        max_iterations: int = 30,
        rtol: float = 1e-3,
        lr_rule: Optional[str] = None,
    ) -> None:
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
            raise ValueError(f"SharpnessMonitor(max_iterations={max_iterations!r}): a positive int, e.g. 30.")
        if not 0.0 < rtol < 1.0:
            raise ValueError(f"SharpnessMonitor(rtol={rtol!r}): a relative tolerance in (0, 1), e.g. 1e-3.")
        self.steps = _check_steps(steps)
        self.max_iterations, self.rtol = max_iterations, rtol
        self.lr_rule = None if lr_rule is None else check_rule(lr_rule)
        self.measurements: list[tuple[int, float]] = []  # (global step, λ_max: max over ranks)
        self.failure: Optional[str] = None

    # ------------------------------------------------------------------ results
    @property
    def largest(self) -> Optional[float]:
        """The largest ``λ_max`` measured so far; ``None`` when nothing was measured or a measurement failed."""
        if self.failure is not None or not self.measurements:
            return None
        return max(value for _, value in self.measurements)

    def _due(self, global_step: int) -> bool:
        done = self.measurements[-1][0] if self.measurements else -1
        return any(done < s <= global_step for s in self.steps)

    # ------------------------------------------------------------------ the hook
    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, quiet: Quiet = nullcontext
    ) -> None:
        """Measure if this batch starts an optimizer step that is due; ``quiet()`` is entered around the passes
        (the meter's ``paused``: its hooks must not see them). Never raises."""
        if self.failure is not None or batch_idx % max(1, trainer.accumulate_grad_batches) != 0:
            return
        if not self._due(trainer.global_step) or not self.applies(trainer, pl_module):
            return
        try:
            local = self._measure(trainer, pl_module, batch, batch_idx, quiet)
        except Exception as exc:  # noqa: BLE001 - the run must go on; the reduce below keeps ranks in step
            local = _failed(exc)
        self._record(trainer, *_max_over_ranks(trainer, local))

    def applies(self, trainer: Any, pl_module: Any) -> bool:
        """SGD-family rule (see ``lr_rule``) and automatic optimization: the cases ``λ_max`` is used for."""
        if not getattr(pl_module, "automatic_optimization", True) or not trainer.optimizers:
            return False
        rule = self.lr_rule or lr_rule_for(trainer.optimizers[0])[0]
        return rule in SGD_RULES

    def _measure(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, quiet: Quiet) -> tuple[float, str]:
        step = lightning_step(pl_module, None, batch_idx)  # no autocast: the double backward in full precision
        params = [p for p in pl_module.parameters() if p.requires_grad]
        # Attention by the math kernel: the fused ones (flash, memory-efficient) have no double backward.
        with quiet(), aside_from_the_run(trainer, pl_module), torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            hvp = hessian_vector_product_fn(lambda: step(batch), params)
            value = lanczos_top_eigenvalue(hvp, _random_start(params, trainer.global_step),
                                           max_iterations=self.max_iterations, rtol=self.rtol)
        return value, "" if math.isfinite(value) else f"λ_max = {value} (a non-finite loss or Hessian)"

    def _record(self, trainer: Any, value: float, reason: str) -> None:
        if reason:
            self.failure = reason
            _warn_once(trainer, f"SharpnessMonitor: λ_max not measured ({reason}); the recommendation holds an SGD "
                                "learning rate on a batch increase instead of raising it to the stability limit.")
        else:
            self.measurements.append((int(trainer.global_step), float(value)))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain types only (checkpoints load with ``weights_only=True``)."""
        return {"version": STATE_VERSION, "measurements": [list(m) for m in self.measurements],
                "failure": self.failure}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"SharpnessMonitor.load_state_dict: unknown state version {state.get('version')!r}")
        self.measurements = [(int(s), float(v)) for s, v in state["measurements"]]
        self.failure = state.get("failure")


def _random_start(params: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """A Gaussian start vector from its own generator (the run's RNG streams are not drawn from)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) for p in params]


def _failed(exc: BaseException) -> tuple[float, str]:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return math.nan, f"{type(exc).__name__}: {message}"[:300]


def _max_over_ranks(trainer: Any, local: tuple[float, str]) -> tuple[float, str]:
    """``(max λ over ranks, reason)``; a failure on any rank is a failure on all (one MAX all-reduce)."""
    value, reason = local
    if trainer.world_size <= 1:
        return value, reason
    packed = torch.tensor([-math.inf if reason else value, 1.0 if reason else 0.0], dtype=torch.float64,
                          device=trainer.strategy.root_device)
    top, failed = trainer.strategy.reduce(packed, reduce_op="max").cpu().tolist()
    if failed and not reason:
        reason = "the measurement failed on another rank"
    return top, reason


def _warn_once(trainer: Any, message: str) -> None:
    if trainer.is_global_zero or trainer.world_size <= 1:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
