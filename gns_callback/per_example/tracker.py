"""Hook glue that accumulates exact per-example squared gradient norms during ``backward``.

No Lightning dependency: attach to any ``nn.Module``, run forward + backward, then :meth:`pop`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .conv import conv_sq_norms
from .embedding import embedding_sq_norms, embedding_unsupported_reason
from .linear import linear_sq_norms
from .normalization import group_norm_sq_norms, layer_norm_sq_norms, rms_norm_sq_norms

__all__ = ["SUPPORTED_MODULES", "PerExampleNormTracker"]

SqNormFunction = Callable[..., Tensor]

#: Exact module types handled. Subclasses are deliberately not matched: a subclass may override
#: ``forward`` so that the gradient w.r.t. its output is no longer the gradient w.r.t. the base op.
SUPPORTED_MODULES: dict[type[nn.Module], SqNormFunction] = {
    nn.Linear: linear_sq_norms,
    nn.Conv1d: conv_sq_norms,
    nn.Conv2d: conv_sq_norms,
    nn.Embedding: embedding_sq_norms,
    nn.LayerNorm: layer_norm_sq_norms,
    nn.GroupNorm: group_norm_sq_norms,
    nn.RMSNorm: rms_norm_sq_norms,
}

#: The layer functions measure exactly these parameters of a supported module.
_MEASURED_PARAM_NAMES = frozenset({"weight", "bias"})

_MICRO_BATCH_HINT = 'use method="micro_batch" for this model'


@dataclass(frozen=True)
class _CoveredModule:
    name: str
    param_names: frozenset[str]
    sq_norms: SqNormFunction


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class PerExampleNormTracker:
    """Accumulates ``|g_i|²`` per example over the parameters of supported layers.

    ``g_i`` is example ``i``'s contribution to the gradient of exactly the loss that was
    backpropagated, summed over all covered parameters. No scaling is applied: if the loss is a mean
    over the batch of size B, each ``g_i`` carries a ``1/B`` factor (so the result carries ``1/B²``);
    rescaling is the caller's job.

    Supported layers are listed in :data:`SUPPORTED_MODULES`. A trainable parameter is *covered*
    when it belongs to exactly one supported module; parameters of other modules, parameters shared
    between modules (tied weights) and embeddings with unsupported options are left out and listed in
    :attr:`excluded_reasons`.

    Errors are raised (from ``backward``) instead of returning wrong numbers when a covered module's
    output gradient arrives twice in one backward pass (the module was applied more than once: the
    norm of a summed gradient is not the sum of norms), when a covered parameter receives a gradient
    without its module's output gradient (used outside the module's forward, e.g. ``F.linear(x,
    lin.weight)``), and when modules disagree about the batch size (batch dim must be dim 0).

    The tracker must be :attr:`enabled` during both forward and backward. While disabled, hooks
    return immediately. Coverage is decided at :meth:`attach`; re-attach after changing
    ``requires_grad``. Known blind spot: a parameter used *both* by its module and functionally
    elsewhere (e.g. ``logits = h @ embedding.weight.T``) is not detected; tie weights by sharing the
    Parameter between modules instead, which is detected.
    """

    def __init__(self, model: nn.Module, max_examples: int | None = None) -> None:
        self.model = model
        self.enabled = True
        #: Measure only the first ``max_examples`` examples of each batch (None: all). Their mean squared
        #: norm is still unbiased for i.i.d. batches, at a fraction of the cost.
        self.max_examples = max_examples
        #: Full batch size of the backward pass(es) returned by the last :meth:`pop`.
        self.last_batch_size: int | None = None
        self._batch_size: int | None = None
        self.excluded_reasons: dict[str, str] = {}
        self._covered_modules: dict[nn.Module, _CoveredModule] = {}
        self._covered_params: list[tuple[str, nn.Parameter]] = []
        self._uncovered_params: list[tuple[str, nn.Parameter]] = []
        self._handles: list[RemovableHandle] = []
        self._attached = False
        self._running: Tensor | None = None
        self._batch_size_source = ""
        self._saw_tracked_forward = False
        self._pass_id: int | None = None
        self._fired_this_pass: set[nn.Module] = set()
        self._analyse()

    # ------------------------------------------------------------------ coverage

    def _analyse(self) -> None:
        owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            for local_name, param in module.named_parameters(recurse=False):
                owners.setdefault(id(param), []).append((module_name, module, local_name))

        self.excluded_reasons = {}
        self._covered_modules = {}
        self._covered_params = []
        self._uncovered_params = []
        covered_names: dict[nn.Module, tuple[str, set[str]]] = {}
        for param_name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            entries = owners[id(param)]
            distinct_modules = {id(module): module for _, module, _ in entries}
            reason = None
            if len(distinct_modules) > 1:
                aliases = ", ".join(_qualified(m, n) for m, _, n in entries)
                reason = (
                    f"shared by several modules ({aliases}); the per-example norm of the summed "
                    "gradient is not the sum of per-module norms"
                )
            else:
                module_name, module, local_name = entries[0]
                if type(module) not in SUPPORTED_MODULES:
                    reason = f"unsupported module type {type(module).__name__}"
                elif local_name not in _MEASURED_PARAM_NAMES:
                    reason = f"extra parameter '{local_name}' on {type(module).__name__} is not measured"
                elif isinstance(module, nn.Embedding):
                    reason = embedding_unsupported_reason(module)
            if reason is not None:
                self.excluded_reasons[param_name] = reason
                self._uncovered_params.append((param_name, param))
                continue
            self._covered_params.append((param_name, param))
            covered_names.setdefault(module, (module_name, set()))[1].add(local_name)

        for module, (module_name, local_names) in covered_names.items():
            self._covered_modules[module] = _CoveredModule(
                name=module_name or type(module).__name__,
                param_names=frozenset(local_names),
                sq_norms=SUPPORTED_MODULES[type(module)],
            )

    def covered_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters whose per-example norms are measured."""
        return [param for _, param in self._covered_params]

    def uncovered_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(qualified name, parameter)`` of trainable parameters that are not measured."""
        return list(self._uncovered_params)

    def coverage_fraction(self) -> float:
        """Covered numel / trainable numel (0.0 for a model without trainable parameters)."""
        covered = sum(param.numel() for _, param in self._covered_params)
        total = covered + sum(param.numel() for _, param in self._uncovered_params)
        return covered / total if total else 0.0

    def has_batchnorm_in_training(self) -> bool:
        """Whether a BatchNorm layer (incl. SyncBatchNorm) normalises with batch statistics now.

        Such layers couple the examples of a batch, so per-example gradients are not independent.
        """
        return any(
            isinstance(module, nn.modules.batchnorm._BatchNorm)
            and (module.training or not module.track_running_stats)
            for module in self.model.modules()
        )

    # ------------------------------------------------------------------ lifecycle

    def attach(self) -> PerExampleNormTracker:
        """(Re-)decide coverage and register the hooks. Returns ``self``."""
        self.detach()
        self._analyse()
        for module, covered in self._covered_modules.items():
            self._handles.append(module.register_forward_hook(self._on_forward, with_kwargs=True))
            for local_name in sorted(covered.param_names):
                param = getattr(module, local_name)
                qualified = _qualified(covered.name, local_name)
                self._handles.append(param.register_hook(partial(self._on_param_grad, module, qualified)))
        self._attached = True
        self._reset_state()
        return self

    def detach(self) -> None:
        """Remove every hook from the model. Hooks already placed on live output tensors go inert."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._attached = False
        self._reset_state()

    def __enter__(self) -> PerExampleNormTracker:
        return self.attach()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.detach()

    def pop(self) -> Tensor | None:
        """Per-example squared norms (B,), float32, summed over covered modules and over the backward
        passes since the last pop; None if nothing was measured. Resets. Does not sync the device."""
        result = self._running
        self.last_batch_size = self._batch_size
        self._reset_state()
        return result

    def _reset_state(self) -> None:
        self._running = None
        self._batch_size = None
        self._batch_size_source = ""
        self._saw_tracked_forward = False
        self._pass_id = None
        self._fired_this_pass = set()

    # ------------------------------------------------------------------ hooks

    def _active(self) -> bool:
        return self.enabled and self._attached

    def _on_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if not self._active():
            return
        if not (isinstance(output, Tensor) and output.requires_grad and torch.is_grad_enabled()):
            return
        inp = args[0] if args else kwargs.get("input")
        if not isinstance(inp, Tensor):
            return
        self._saw_tracked_forward = True
        # The hook lives on the output's autograd node, so the saved input is freed with the graph.
        output.register_hook(partial(self._on_output_grad, module, inp.detach()))

    def _enter_pass(self) -> None:
        pass_id = torch._C._current_graph_task_id()
        if pass_id != self._pass_id:
            self._pass_id = pass_id
            self._fired_this_pass = set()

    def _on_output_grad(self, module: nn.Module, inp: Tensor, grad_output: Tensor) -> None:
        if not self._active() or module not in self._covered_modules:
            return
        covered = self._covered_modules[module]
        self._enter_pass()
        if module in self._fired_this_pass:
            self._fired_this_pass = set()
            raise RuntimeError(
                f"PerExampleNormTracker: module '{covered.name}' ({type(module).__name__}) was applied "
                "more than once in the forward pass and received several output gradients in one "
                "backward pass. The per-example norm of the summed gradient is not the sum of "
                f"per-call norms, so it can't be measured with hooks; {_MICRO_BATCH_HINT}."
            )
        self._fired_this_pass.add(module)
        self._check_batch_size(grad_output.shape[0], covered.name)
        if self.max_examples is not None and grad_output.shape[0] > self.max_examples:
            inp, grad_output = inp[: self.max_examples], grad_output[: self.max_examples]
        with torch.no_grad():
            sq_norms = covered.sq_norms(module, inp, grad_output, param_names=covered.param_names)
        self._accumulate(sq_norms.float())

    def _on_param_grad(self, module: nn.Module, param_name: str, grad: Tensor) -> None:
        if not self._active() or not self._saw_tracked_forward:
            return
        self._enter_pass()
        if module not in self._fired_this_pass:
            raise RuntimeError(
                f"PerExampleNormTracker: parameter '{param_name}' received a gradient that did not "
                "flow through its module's output: it is used outside the module's forward (e.g. "
                f"F.linear(x, module.weight)), so its per-example norm can't be measured; "
                f"{_MICRO_BATCH_HINT}."
            )

    def _check_batch_size(self, batch_size: int, source: str) -> None:
        if self._batch_size is None:
            self._batch_size, self._batch_size_source = batch_size, source
        elif batch_size != self._batch_size:
            raise RuntimeError(
                f"PerExampleNormTracker: module '{source}' saw batch size {batch_size} but "
                f"'{self._batch_size_source}' saw {self._batch_size}. Every covered module must receive "
                "inputs with the batch as dim 0 (and pop() must be called between backward passes over "
                "batches of different sizes)."
            )

    def _accumulate(self, sq_norms: Tensor) -> None:
        if self._running is None:
            self._running = sq_norms
        else:
            self._running.add_(sq_norms)
