"""Hook glue that accumulates exact per-example squared gradient norms during ``backward``.

No Lightning dependency: attach to any ``nn.Module``, run forward + backward, then :meth:`pop`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial, wraps
from types import TracebackType
from typing import Any, ContextManager, Optional
import warnings

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from gns_callback.backward_passes import PassLedger, current_pass, hooks_inert
from gns_callback.batch_size import batch_size_of
from gns_callback.norms import squared_norm
from gns_callback.own_hooks import OwnHook

from . import compiled
from .attention import (
    MEASURED_ATTENTION_PARAMS,
    ProjectionCall,
    ProjectionCalls,
    attention_batch_size,
    attention_query,
    is_attention,
    projection_sq_norms,
)
from .cells import (
    CELL_MODULES,
    CELL_PARAM_NAMES,
    cell_call,
    cell_input_reason,
    cell_outputs,
    cell_sq_norms,
    is_cell,
    state_feeds_output,
)
from .activation import prelu_sq_norms, prelu_summed_grads
from .bare_lookup import LookupGrads, TiedGrads
from .broadcast import (Consumer, ExampleGrads, Rows, adds_up_to, caller_reads, example_grads, examples_dim,
                        find_consumers, rows_per_example)
from .matmul import MAX_ROWS_ELEMENTS, Factors, computed_from_parameters
from .param_path import is_parameter
from .conv import conv_sq_norms, conv_summed_grads
from .conv_transpose import conv_transpose_sq_norms, conv_transpose_summed_grads
from .cost import COSTS, CostFunction, subset_is_cheaper
from .launches import launch_cost
from .embedding import embedding_sq_norms, embedding_summed_grads, embedding_unsupported_reason, shared_table_reason
from .embedding_bag import bag_inputs, embedding_bag_sq_norms, embedding_bag_unsupported_reason
from .layout import LayoutError, LayoutMemory, is_sequence_first, unflattened
from .linear import linear_sq_norms, linear_summed_grads
from .repeated import combinable, concatenate_calls
from .sum_check import SumCheck
from .recurrent import (
    RECURRENT_MODULES,
    input_reason,
    is_recurrent,
    recurrent_batch_size,
    recurrent_param_names,
    recurrent_sq_norms,
    recurrent_unsupported_reason,
)
from .tied import cross_term, logits_at_tokens, same_table, tied_pair
from .transposed_linear import TransposedLinear, layer_kind, transposed_linear_summed_grads
from .subclass import runs_as
from .weight_norm import weight_normed, weight_normed_owner, weight_normed_sq_norms, weight_normed_summed_grads
from .normalization import (
    BATCH_NORMS,
    INSTANCE_NORMS,
    batch_norm_sq_norms,
    batch_norm_summed_grads,
    group_norm_sq_norms,
    group_norm_summed_grads,
    instance_norm_sq_norms,
    instance_norm_summed_grads,
    layer_norm_sq_norms,
    layer_norm_summed_grads,
    rms_norm_sq_norms,
    rms_norm_summed_grads,
)

__all__ = ["SUPPORTED_MODULES", "PerExampleNormTracker", "supported_layer_names"]

SqNormFunction = Callable[..., Tensor]
SummedGradFunction = Callable[..., dict[str, Tensor]]

#: Module types handled (keys: :func:`~.transposed_linear.layer_kind`). A subclass is matched only where it changes
#: nothing but how the layer is built (:func:`~.subclass.runs_as`): one that overrides ``forward`` or anything it
#: reaches may compute something else, so that the gradient w.r.t. its output is no longer the base op's.
SUPPORTED_MODULES: dict[type, SqNormFunction] = {
    nn.Linear: linear_sq_norms,
    TransposedLinear: linear_sq_norms,  # transformers' Conv1D: the same norms as the Linear it transposes
    nn.Conv1d: conv_sq_norms,
    nn.Conv2d: conv_sq_norms,
    nn.Conv3d: conv_sq_norms,
    nn.ConvTranspose1d: conv_transpose_sq_norms,
    nn.ConvTranspose2d: conv_transpose_sq_norms,
    nn.ConvTranspose3d: conv_transpose_sq_norms,
    nn.Embedding: embedding_sq_norms,
    nn.LayerNorm: layer_norm_sq_norms,
    nn.GroupNorm: group_norm_sq_norms,
    **dict.fromkeys(INSTANCE_NORMS, instance_norm_sq_norms),
    **dict.fromkeys(BATCH_NORMS, batch_norm_sq_norms),
    nn.PReLU: prelu_sq_norms,
    nn.RMSNorm: rms_norm_sq_norms,
}

#: Per supported type, the gradient a subset of the batch's examples contributes (``max_examples`` below the batch
#: size): with it, the unmeasured examples' summed gradient is the pass's gradient minus the subset's.
SUMMED_GRADIENTS: dict[type, SummedGradFunction] = {
    nn.Linear: linear_summed_grads,
    TransposedLinear: transposed_linear_summed_grads,
    nn.Conv1d: conv_summed_grads,
    nn.Conv2d: conv_summed_grads,
    nn.Conv3d: conv_summed_grads,
    nn.ConvTranspose1d: conv_transpose_summed_grads,
    nn.ConvTranspose2d: conv_transpose_summed_grads,
    nn.ConvTranspose3d: conv_transpose_summed_grads,
    nn.Embedding: embedding_summed_grads,
    nn.LayerNorm: layer_norm_summed_grads,
    nn.GroupNorm: group_norm_summed_grads,
    **dict.fromkeys(INSTANCE_NORMS, instance_norm_summed_grads),
    **dict.fromkeys(BATCH_NORMS, batch_norm_summed_grads),
    nn.PReLU: prelu_summed_grads,
    nn.RMSNorm: rms_norm_summed_grads,
}

#: Modules measured by hooks of their own rather than a layer function (:mod:`.embedding_bag`, :mod:`.attention`,
#: :mod:`.recurrent`, :mod:`.cells`); matched exactly, as :data:`SUPPORTED_MODULES`. None of them assembles a
#: subset's summed gradient, so with any of them every example is measured.
HANDLED_APART: tuple[type, ...] = (nn.EmbeddingBag, nn.MultiheadAttention, *RECURRENT_MODULES, *CELL_MODULES)

#: Pops at whose forwards a layer's input is checked for being computed from parameters alone (a table, not the
#: examples: :func:`~.matmul.computed_from_parameters`); a walk of the autograd graph, left off after them for its cost.
TABLE_CHECK_POPS = 8


def misread_batch_reason(reason: str) -> str:
    """``reason`` (a layer holds more examples than the batch's size read off its tensors) with
    :data:`MISREAD_BATCH_SIZE`, why, and the fix."""
    return f"{reason}: {MISREAD_BATCH_SIZE}; {_MISREAD_FIX}"


def supported_layer_names() -> str:
    """The layer types per-example norms measure, for messages: :data:`SUPPORTED_MODULES` and
    :data:`HANDLED_APART`."""
    names = ["transformers' Conv1D" if kind is TransposedLinear else kind.__name__ for kind in SUPPORTED_MODULES]
    return ", ".join(names + [kind.__name__ for kind in HANDLED_APART])


#: The layer functions measure exactly these parameters of a supported module (an ``nn.MultiheadAttention``:
#: :data:`~.attention.MEASURED_ATTENTION_PARAMS`, its ``out_proj`` included).
_MEASURED_PARAM_NAMES = frozenset({"weight", "bias"})

#: Under ``method="auto"``, per-example norms are used only if they cover at least this share of the trainable
#: parameters; below it ``micro_batch`` (which covers all of them) is preferred where the run allows it, and
#: otherwise a warning states the share. B_simple of a subset of the parameters is a different quantity. A position
#: table found at run time is left out only while the rest keeps this share.
MIN_COVERAGE = 0.9

MICRO_BATCH_HINT = (
    "measure this model with method='micro_batch', which needs several backward passes per optimizer step "
    "(gradient accumulation, e.g. Lightning's accumulate_grad_batches=2, or several devices)"
)
#: Marks a failure where the micro-batch's size read off the batch is not its count of examples: a sequence-first
#: layer (``batch_first=False``) holds more examples in dim 1 than that. ``micro_batch`` would read its noise at the
#: same wrong size, so no method measures it (:data:`~.checks.NO_METHOD`).
MISREAD_BATCH_SIZE = "the micro-batch's size read off the batch is not its count of examples"
#: Why, and the fix (:func:`misread_batch_reason`).
_MISREAD_FIX = (
    "its tensors are most likely sequence-first, (T, B, ...) as pad_sequence returns them by default, so their dim 0 "
    "read the sequence length; micro_batch would divide by that size too. The fix: a batch-first batch "
    "(pad_sequence(..., batch_first=True), and x.transpose(0, 1) in the model's forward where it is sequence-first); "
    "in a plain loop, pass the size instead: check_batch(loss_of, batch, batch_size=B), expect_batch_size(B) and "
    "step(micro_batch_size=B)"
)


@dataclass
class PassNorms:
    """What one backward pass contributed: per-example squared norms summed over covered modules, and, when only
    some of its examples are measured, ``|Σ_{i unmeasured} g_i|²`` summed over covered parameters."""

    sq_norms: Tensor | None = None
    unmeasured_sq: Tensor | None = None
    #: The measured examples' summed gradient per parameter, until that parameter's whole gradient arrives.
    subset_grads: dict[str, Tensor] = field(default_factory=dict)
    #: Per module whose norms wait for its parameters' gradient, its calls' ``(input, output gradient)`` so far,
    #: batch first (:mod:`.repeated`: a layer applied several times is measured once, over all its calls).
    calls: dict = field(default_factory=dict)
    #: Whether this pass measures only ``max_examples`` examples (decided at its first measured layer).
    subset: bool | None = None
    batch_size: int | None = None
    source: str = ""
    fired: set = field(default_factory=set)
    failure: str | None = None  # why this pass can't be measured (matters only if it fills ``.grad``)
    #: A layer was left out during this pass, which its norms therefore half hold: its step is not measured.
    dropped: bool = False
    #: Per module of a tied table (:mod:`.tied`) measured in this pass, its calls read as one, ``(input, output
    #: gradient)``, until its partner's are in for the cross term.
    tied_calls: dict = field(default_factory=dict)
    #: Per bare parameter (:mod:`.broadcast`), its per-example gradients at its broadcasts so far (``Rows``), and
    #: at its matrix products (``Factors``, :mod:`.matmul`), until its gradient comes.
    broadcast: dict = field(default_factory=dict)
    products: dict = field(default_factory=dict)
    #: The bare parameters whose per-example gradients were read from half-precision tensors (autocast).
    half_inputs: set = field(default_factory=set)
    #: A layer whose several calls were read as one while the batch's size was unknown (:mod:`.repeated`), or None:
    #: its rows may be the same examples at each call (a recurrence, a siamese encoder) or chunks of the batch.
    calls_unsized: str | None = None

    def add(self, sq_norms: Tensor) -> None:
        self.sq_norms = sq_norms if self.sq_norms is None else self.sq_norms + sq_norms

    def merged(self, inner: PassNorms) -> PassNorms:
        """This pass with ``inner``, another part of the same backward pass (a reentrant checkpoint's segment,
        :class:`~gns_callback.backward_passes.PassLedger`): per-example norms add over layers. Where they can't be
        added, the pass fails with the reason."""
        problem = self.failure or inner.failure or _merge_problem(self, inner)
        if problem is not None:
            self.failure = problem
            return self
        self.fired |= inner.fired
        self.dropped |= inner.dropped
        self.subset_grads.update(inner.subset_grads)
        for kept, more in ((self.broadcast, inner.broadcast), (self.products, inner.products)):
            for name, grads in more.items():
                kept[name] = kept[name].joined(grads) if name in kept else grads
        self.half_inputs |= inner.half_inputs
        self.calls_unsized = self.calls_unsized or inner.calls_unsized
        self.calls.update(inner.calls)
        if inner.sq_norms is not None:
            self.add(inner.sq_norms)
        if inner.unmeasured_sq is not None:
            self.unmeasured_sq = inner.unmeasured_sq + (0 if self.unmeasured_sq is None else self.unmeasured_sq)
        if self.batch_size is None:
            self.batch_size, self.source, self.subset = inner.batch_size, inner.source, inner.subset
        return self

    def add_unmeasured(self, param_name: str, grad: Tensor) -> None:
        """Add ``|grad − Σ_{i measured} g_i|²`` for one parameter whose pass gradient ``grad`` just arrived."""
        sq = squared_norm(self.subset_grads.pop(param_name).sub_(grad))  # ours to overwrite: no new buffer
        self.unmeasured_sq = sq if self.unmeasured_sq is None else self.unmeasured_sq + sq


def _never_raises(hook: Callable[..., Any]) -> Callable[..., Any]:
    """A hook of the tracker that can't end the user's run: an error inside it stops the measurement, with the
    error as the reason, and the forward or backward it ran in goes on as without the hook."""
    @wraps(hook)
    def guarded(self: PerExampleNormTracker, *args: Any, **kwargs: Any) -> Any:
        try:
            return hook(self, *args, **kwargs)
        except Exception as error:  # noqa: BLE001 - a hook must never end the user's run
            self._fail(f"an error inside its hook {hook.__name__} ({type(error).__name__}: {error}): a bug in "
                       f"gns_callback, please report it with the model. Training goes on as without the callback; "
                       f"{MICRO_BATCH_HINT}.")
            return None
    return guarded


def _merge_problem(outer: PassNorms, inner: PassNorms) -> Optional[str]:
    """Why two records of one backward pass (:meth:`PassNorms.merged`) can't be added, or None."""
    hint = f"pass use_reentrant=False to torch.utils.checkpoint, or {MICRO_BATCH_HINT}"
    if outer.fired & inner.fired:
        names = ", ".join(sorted(type(m).__name__ for m in outer.fired & inner.fired))
        return (f"a layer ({names}) ran both inside and outside a reentrant gradient checkpoint: its per-example norm "
                f"is not the sum of the two parts; {hint}.")
    measured = {(r.batch_size, r.subset) for r in (outer, inner) if r.batch_size is not None}
    if len(measured) > 1 or any(r.tied_calls for r in (outer, inner)):
        return ("a reentrant gradient checkpoint's segment and the rest of the model were measured differently (other "
                f"batch sizes, a subset of examples in one only, or a tied table across them); {hint}.")
    return None


@dataclass(frozen=True)
class _CoveredModule:
    """A measured module; the three functions are None for an ``nn.MultiheadAttention`` (:mod:`.attention`)."""

    name: str
    param_names: frozenset[str]
    sq_norms: Optional[SqNormFunction]
    summed_grads: Optional[SummedGradFunction]
    cost: Optional[CostFunction]
    param_count: int


@dataclass
class _BareParameter:
    """A trainable parameter of a module no layer function measures (a ViT's class token, a layer scale): left out
    until its first backward pass shows that its per-example gradients are read at its broadcasts
    (:mod:`.broadcast`), measured from then on, left out for good with ``refused`` where they are not. Its uses are
    looked for in the forwards of its ``owners``: the module holding it, or each of several holding one table."""

    name: str
    param: nn.Parameter
    owners: tuple[nn.Module, ...]
    measured: bool = False
    refused: Optional[str] = None

    def owned_by(self, module: nn.Module) -> bool:
        return any(owner is module for owner in self.owners)


def _unmeasured_reason(module: nn.Module, local_name: str) -> Optional[str]:
    """Why the parameter ``local_name`` of its only module ``module`` is not measured, or None."""
    if is_recurrent(module):
        return recurrent_unsupported_reason(module) if local_name in recurrent_param_names(module) else (
            f"extra parameter '{local_name}' on {type(module).__name__} is not measured")
    if is_cell(module):
        return None if local_name in CELL_PARAM_NAMES else (
            f"extra parameter '{local_name}' on {type(module).__name__} is not measured")
    if _is_bag(module):
        return embedding_bag_unsupported_reason(module)
    if _holds_bare_parameters(module):
        return f"unsupported module type {type(module).__name__}"
    measured = MEASURED_ATTENTION_PARAMS if is_attention(module) else _MEASURED_PARAM_NAMES
    normed = weight_normed(module)
    if normed is not None and local_name in (normed.g_name, normed.v_name):
        return None
    if local_name not in measured:
        return f"extra parameter '{local_name}' on {type(module).__name__} is not measured"
    if isinstance(module, nn.Embedding):
        return embedding_unsupported_reason(module)
    return None


def _own_parameter(module: nn.Module, local_name: str) -> Optional[nn.Parameter]:
    """``module``'s parameter registered as ``local_name`` now (``"out_proj.weight"`` reaches into a submodule);
    None if it has none by that name."""
    owner_name, _, leaf = local_name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module)._parameters.get(leaf)


def _replaced_reason(param_name: str) -> str:
    """Why a layer whose parameter was moved off it mid-run can't be measured per example."""
    return (f"parameter '{param_name}' is no longer its layer's own: it was pruned or reparametrized during the run "
            "(torch.nn.utils.prune, Lightning's ModelPruning, a parametrization such as weight_norm), so the layer's "
            f"per-example gradients are no longer the parameter's; {MICRO_BATCH_HINT}")


def _parents(model: nn.Module) -> dict[int, nn.Module]:
    """Each submodule's parent, by the submodule's ``id``."""
    return {id(child): parent for parent in model.modules() for child in parent.children()}


def _calling_module(parents: dict[int, nn.Module], module: nn.Module) -> Optional[nn.Module]:
    """The module whose forward presumably calls ``module``: its parent (``parents``: by child ``id``), or the
    nearest ancestor with a forward of its own (a ``ModuleDict`` or ``ModuleList`` has none). None for the root or
    a module outside the model. A wrong guess is safe: no broadcast is seen, or the sum check fails, and the table
    stays left out."""
    parent = parents.get(id(module))
    while parent is not None and type(parent).forward is nn.Module.forward:
        parent = parents.get(id(parent))
    return parent


def _bare_owners(holders: list[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules whose forwards are searched for the uses of a bare parameter held by ``holders`` (by no layer this
    package knows): its only holder; each of several holding one table (BART's ``shared``, ``encoder.embed_tokens``
    and ``decoder.embed_tokens``, and ``lm_head``: an ``nn.Linear`` is read at its product). None where a holder is
    another layer this package knows."""
    if len(holders) == 1:
        return tuple(holders) if _holds_bare_parameters(holders[0]) else ()
    return tuple(holders) if all(_holds_bare_parameters(m) or type(m) is nn.Linear for m in holders) else ()


def _holds_bare_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s own parameters are used by code of its own rather than by a layer this package knows:
    their per-example gradients can be read only where they are broadcast (:mod:`.broadcast`)."""
    return (layer_kind(module) not in SUPPORTED_MODULES and not is_attention(module) and not is_recurrent(module)
            and not is_cell(module) and not _is_bag(module))


def _is_bag(module: nn.Module) -> bool:
    """``nn.EmbeddingBag`` (:mod:`.embedding_bag`), or a subclass that runs as it (:func:`~.subclass.runs_as`)."""
    return runs_as(type(module)) is nn.EmbeddingBag


def _no_grad() -> ContextManager[Any]:
    """``torch.no_grad()`` where gradients are on; nothing where they are off already, as in every hook that runs
    inside a backward pass without ``create_graph`` (entering ``torch.no_grad()`` costs about 8 µs)."""
    return torch.no_grad() if torch.is_grad_enabled() else nullcontext()


def _recurrent_outputs(output: Any) -> list[tuple[int, Tensor]]:
    """``(index, tensor)`` of a recurrent module's outputs that require grad: 0 ``output``, 1 ``h_n``, 2 ``c_n``
    (a packed ``output`` by its data)."""
    if not isinstance(output, tuple) or len(output) != 2:
        return []
    out, hidden = output
    out = out.data if isinstance(out, PackedSequence) else out
    tensors = [out, *(hidden if isinstance(hidden, tuple) else (hidden,))]
    return [(k, t) for k, t in enumerate(tensors) if isinstance(t, Tensor) and t.requires_grad]


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class PerExampleNormTracker:
    """Accumulates ``|g_i|²`` per example over the parameters of supported layers.

    ``g_i`` is example ``i``'s contribution to the gradient of exactly the loss that was
    backpropagated, summed over all covered parameters. No scaling is applied: if the loss is a mean
    over the batch of size B, each ``g_i`` carries a ``1/B`` factor (so the result carries ``1/B²``);
    rescaling is the caller's job.

    Supported layers are listed in :data:`SUPPORTED_MODULES`. A trainable parameter is *covered*
    when it belongs to exactly one supported module, or is the ``weight`` tied between one ``nn.Embedding`` and
    one ``nn.Linear`` (a language model's input and output embeddings, :mod:`.tied`; a subset of the examples is
    then never measured); parameters of other modules, other parameters shared between modules and embeddings
    with unsupported options are left out and listed in :attr:`excluded_reasons`.

    Errors are raised (from :meth:`pop_passes`; hooks never raise inside ``backward``) instead of returning
    wrong numbers when a covered module's output gradient arrives twice in one backward pass and its calls can't be
    read as one (a convolution or GroupNorm applied more than once: the norm of a summed gradient is not the sum of
    norms; Linear, Embedding, LayerNorm and RMSNorm calls are measured together, :mod:`.repeated`), when a layer
    runs on a learned parameter instead of examples (``project(prototypes)``), when a covered parameter receives a
    gradient without its module's output gradient (used outside the module's forward, e.g.
    ``F.linear(x, lin.weight)``), when a ``create_graph=True`` pass reaches a covered module, and when the batch
    dim of a module's input can't be told (:mod:`~gns_callback.per_example.layout`).

    Set :attr:`expected_batch_size` to the micro-batch's size before its forward pass: each module's batch dim is
    then checked against it, and sequence-first inputs ``(T, B, ...)`` are measured along dim 1. Left None, dim 0
    is taken, all modules must agree on it, and a model with ``batch_first=False`` modules is refused.

    The tracker must be :attr:`enabled` during both forward and backward. While disabled, hooks
    return immediately. Coverage is decided at :meth:`attach`; re-attach after changing
    ``requires_grad``. A parameter used *both* by its module and functionally elsewhere (e.g.
    ``logits = h @ embedding.weight.T``) is not detected at each step: :attr:`sum_check` (run once, by
    :mod:`.checks` or on the meter's first measured step) finds it; tie weights by sharing the Parameter between an
    Embedding and a Linear instead, which is measured.
    """

    def __init__(self, model: nn.Module, max_examples: int | None = None) -> None:
        self.model = model
        self._batch_norms: Optional[tuple[nn.Module, ...]] = None  # the model's BatchNorm layers, found once
        self.enabled = True
        #: Measure only the first ``max_examples`` examples of each batch, when that is cheaper than measuring
        #: every example (:mod:`.cost`; None: always all). Each such pass also records the unmeasured examples'
        #: summed gradient norm, ``PassNorms.unmeasured_sq``.
        self.max_examples = max_examples
        #: Examples in the micro-batch whose forward/backward runs next (None: unknown, see the class docstring).
        self.expected_batch_size: int | None = None
        #: Full batch size of the backward pass(es) returned by the last :meth:`pop`.
        self.last_batch_size: int | None = None
        #: Why measuring stopped (set by a hook, which never raises inside the user's backward), or None.
        self.failure: str | None = None
        #: Set, each parameter's gradient is compared with the sum of its layers' per-example gradients
        #: (:mod:`.sum_check`; a check, once: it costs a weight gradient per layer).
        self.sum_check: SumCheck | None = None
        self.excluded_reasons: dict[str, str] = {}
        #: Set, the hooks measure inside :func:`~gns_callback.backward_passes.measurement_paused` too (a check's own
        #: tracker, which runs its passes while every meter is paused).
        self.runs_when_paused = False
        self._covered_modules: dict[nn.Module, _CoveredModule] = {}
        self._covered_params: list[tuple[str, nn.Parameter]] = []
        self._uncovered_params: list[tuple[str, nn.Parameter]] = []
        self._handles: list[RemovableHandle] = []
        self._attached = False
        self._passes: PassLedger[PassNorms] = PassLedger(new=PassNorms, merge=PassNorms.merged)
        # ``proj(2 * self.prototypes)``, ``2 * B @ A``: a layer's input or a product's rows computed from parameters
        # alone are looked for at the first TABLE_CHECK_POPS pops only (a walk of their graph; the model's
        # structure, not its data)
        self._table_checks_left = TABLE_CHECK_POPS
        self._forward_costs: list[tuple[float, float, int]] = []  # per covered layer run since the last decision
        self._last_subset: Optional[bool] = None  # that decision (:meth:`_measures_subset`)
        self._forward_launch_cost = 0.0  # what a kernel launch costs on the device those layers ran on
        self._shared_tables: dict[nn.Module, Optional[str]] = {}  # embedding → why it is a shared position table
        self._saw_tracked_forward = False
        self._sequence_first = False
        self._model_batches: set[Optional[int]] = set()  # examples per model forward since the last pop
        self._model_forwards = 0  # the model's own forwards since the last pop
        self._model_outputs: set[int] = set()  # rows of the model's outputs (one tensor each) since the last pop
        self._layouts = LayoutMemory()  # per layer, the batch dim of its input where its shape told it
        self._captures: dict[nn.Module, ProjectionCalls] = {}  # attention modules inside their forward now
        self._analyse()

    # ------------------------------------------------------------------ coverage

    def _owners(self) -> dict[int, list[tuple[str, nn.Module, str]]]:
        """Per parameter, ``(module name, module, local name)`` of every module holding it; an attention module's
        ``out_proj`` parameters belong to the attention module (``"out_proj.weight"``), which applies them; a
        weight-normalised layer's ``g`` and ``v`` belong to the layer (``"parametrizations.weight.original0"``)."""
        owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            for local_name, param in module.named_parameters(recurse=False):
                owners.setdefault(id(param), []).append((module_name, module, local_name))
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            holder, prefix = ((module.out_proj, "out_proj.") if is_attention(module)
                              else (weight_normed_owner(module), "parametrizations.weight."))
            for local_name, param in (holder.named_parameters(recurse=False) if holder is not None else ()):
                owners[id(param)] = [(module_name, module, f"{prefix}{local_name}") if owner is holder
                                     else (name, owner, local) for name, owner, local in owners[id(param)]]
        return owners

    def _analyse(self) -> None:
        owners = self._owners()

        self.excluded_reasons = {}
        self._shared_tables = {}
        self._tied: dict[nn.Module, nn.Module] = {}  # embedding ↔ Linear sharing one table (both directions)
        #: Embeddings that share one table with another (T5's ``shared`` and ``encoder.embed_tokens``) → the one
        #: measured: their calls are its calls, read as one module applied several times (:mod:`.repeated`).
        self._aliases: dict[nn.Module, nn.Module] = {}
        self._sequence_first = is_sequence_first(self.model)
        self._covered_modules = {}
        self._covered_params = []
        self._uncovered_params = []
        self._bare: dict[int, _BareParameter] = {}
        #: Per measured embedding, its caller, hooked at attach: its owner should it be a shared position table.
        self._table_callers: dict[nn.Module, nn.Module] = {}
        #: Per module holding bare parameters, its caller, hooked at attach: their owner should it return one as it is.
        self._bare_callers: dict[nn.Module, nn.Module] = {}
        #: Per module holding bare parameters, its running forwards' input nodes (a stack: calls may nest).
        self._owner_inputs: dict[nn.Module, list[list[Any]]] = {}
        covered_names: dict[nn.Module, tuple[str, set[str]]] = {}
        for param_name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            entries = owners[id(param)]
            distinct_modules = {id(module): module for _, module, _ in entries}
            reason = None
            holders = list({id(m): (m, n) for _, m, n in entries}.values())  # (module, local name), each module once
            pair = tied_pair(holders)
            if pair is not None:
                (embedding, *aliases), head = pair
                self._tied.update({embedding: head, head: embedding})
                self._aliases.update({m: embedding for m in aliases})
                self._covered_params.append((param_name, param))
                for module_name, module, local_name in entries:
                    if module is embedding or module is head:
                        covered_names.setdefault(module, (module_name, set()))[1].add(local_name)
                continue
            same = same_table(holders)
            if same is not None:
                self._aliases.update({m: same[0] for m in same[1:]})
                distinct_modules = {id(same[0]): same[0]}
                entries = [entry for entry in entries if entry[1] is same[0]]
            if len(distinct_modules) > 1:
                aliases = ", ".join(_qualified(m, n) for m, _, n in entries)
                reason = (
                    f"shared by several modules ({aliases}); the per-example norm of the summed "
                    "gradient is not the sum of per-module norms"
                )
            else:
                module_name, module, local_name = entries[0]
                reason = _unmeasured_reason(module, local_name)
            if reason is not None:
                self.excluded_reasons[param_name] = reason
                self._uncovered_params.append((param_name, param))
                searched = _bare_owners(list(distinct_modules.values()))
                if searched:
                    self._bare[id(param)] = _BareParameter(param_name, param, searched)
                continue
            self._covered_params.append((param_name, param))
            covered_names.setdefault(module, (module_name, set()))[1].add(local_name)

        for module, (module_name, local_names) in covered_names.items():
            kind = layer_kind(module)
            sq_norms, summed_grads = SUPPORTED_MODULES.get(kind), SUMMED_GRADIENTS.get(kind)
            if weight_normed(module) is not None:
                sq_norms, summed_grads = (partial(weight_normed_sq_norms, sq_norms),
                                          partial(weight_normed_summed_grads, summed_grads))
            self._covered_modules[module] = _CoveredModule(
                name=module_name or type(module).__name__,
                param_names=frozenset(local_names),
                sq_norms=sq_norms,
                summed_grads=summed_grads,
                cost=COSTS.get(kind),
                param_count=sum(module.get_parameter(name).numel() for name in local_names),
            )
        # A subset's summed gradient is not assembled over a tied table's two uses, nor by the modules with hooks of
        # their own; and the cost model does not price a weight-normalised layer's materialised gradients: with any
        # of them, every example is measured.
        self._subset_allowed = not self._tied and not self._aliases and not any(
            type(m) in HANDLED_APART or weight_normed(m) is not None for m in self._covered_modules)

    def covered_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters whose per-example norms are measured."""
        return [param for _, param in self._covered_params]

    def measured_modules(self) -> list[nn.Module]:
        """The modules whose parameters are measured."""
        return list(self._covered_modules)

    def uncovered_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(qualified name, parameter)`` of trainable parameters that are not measured."""
        return list(self._uncovered_params)

    def coverage_fraction(self) -> float:
        """Covered numel / trainable numel (0.0 for a model without trainable parameters)."""
        return self._share(sum(param.numel() for _, param in self._covered_params))

    def bare_parameter_fraction(self) -> float:
        """The share of the trainable parameters that are bare parameters not yet measured nor refused
        (:mod:`.broadcast`): measured from their first pass on where their broadcasts are read."""
        return self._share(sum(b.param.numel() for b in self._bare.values() if not b.measured and b.refused is None))

    def _share(self, numel: int) -> float:
        """``numel`` over the trainable parameters' (0.0 for a model without any)."""
        total = sum(p.numel() for _, p in self._covered_params + self._uncovered_params)
        return numel / total if total else 0.0

    def has_batchnorm_in_training(self) -> bool:
        """Whether a BatchNorm layer (incl. SyncBatchNorm) normalises with batch statistics now.

        Such layers couple the examples of a batch, so per-example gradients are not independent.
        """
        if self._batch_norms is None:
            self._batch_norms = tuple(module for module in self.model.modules()
                                      if isinstance(module, nn.modules.batchnorm._BatchNorm))
        return any(module.training or not module.track_running_stats for module in self._batch_norms)

    # ------------------------------------------------------------------ lifecycle

    def attach(self) -> PerExampleNormTracker:
        """(Re-)decide coverage and register the hooks. Returns ``self``."""
        self.detach()
        self._batch_norms = None  # found again at the next mode check: the model may have changed
        self._analyse()
        hooked: set[int] = set()
        for module, covered in self._covered_modules.items():
            self._handles += self._module_hooks(module)
            for local_name in sorted(covered.param_names):
                param = module.get_parameter(local_name)
                if id(param) in hooked:
                    continue  # a tied table: one hook, for both of its modules
                hooked.add(id(param))
                owners = (module, self._tied[module]) if module in self._tied and local_name == "weight" else (module,)
                qualified = _qualified(covered.name, local_name)
                self._handles.append(param.register_hook(
                    OwnHook(partial(self._on_param_grad, owners, qualified, id(param), local_name))))
        self._handles += [alias.register_forward_hook(OwnHook(partial(self._on_alias_forward, measured)),
                                                      with_kwargs=True)
                          for alias, measured in self._aliases.items() if measured in self._covered_modules]
        parents = _parents(self.model)
        self._table_callers, self._bare_callers = self._find_table_callers(parents), self._find_bare_callers(parents)
        self._handles += self._bare_hooks()
        # Bare parameters too: a model may hold nothing else (its layers written out as matrix products).
        self._handles.append(self.model.register_forward_pre_hook(OwnHook(self._on_model_forward),
                                                                  with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(OwnHook(self._on_model_output), with_kwargs=True))
        self._passes.watch([*self.covered_parameters(), *(bare.param for bare in self._bare.values())])
        self._attached = True
        self._reset_state()
        return self

    def _module_hooks(self, module: nn.Module) -> list[RemovableHandle]:
        """The forward hook of a supported layer; around an attention module's forward, the capture of its
        projections (:mod:`.attention`), removed however the forward ends."""
        if is_recurrent(module):
            return [module.register_forward_hook(OwnHook(self._on_recurrent_forward), with_kwargs=True)]
        if is_cell(module):
            return [module.register_forward_hook(OwnHook(self._on_cell_forward), with_kwargs=True)]
        if _is_bag(module):
            return [module.register_forward_hook(OwnHook(self._on_bag_forward), with_kwargs=True)]
        if not is_attention(module):
            return [module.register_forward_hook(OwnHook(self._on_forward), with_kwargs=True)]
        return [module.register_forward_pre_hook(OwnHook(self._on_attention_start), with_kwargs=True),
                module.register_forward_hook(OwnHook(self._on_attention_end), always_call=True)]

    def call_at_pass_end(self, callback: Optional[Callable[[], None]]) -> None:
        """``callback()`` as each backward pass that fills a measured ``.grad`` ends (None: nothing)."""
        self._passes.on_end = callback

    def detach(self) -> None:
        """Remove every hook from the model. Hooks already placed on live output tensors go inert."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._table_callers, self._bare_callers = {}, {}
        self._passes.unwatch()
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

    def pop_passes(self) -> list[PassNorms]:
        """One :class:`PassNorms` per backward pass that accumulated into ``.grad`` since the last pop (passes of
        ``torch.autograd.grad`` are dropped). Raises ``RuntimeError`` with the reason if a hook found the model
        unmeasurable (hooks never raise inside ``backward``). Does not sync the device."""
        committed = self._passes.pop()
        self._table_checks_left = max(0, self._table_checks_left - 1)
        failure = self.failure or next((p.failure for p in committed if p.failure is not None), None)
        if failure is None and any(p.calls for p in committed):
            failure = ("a measured layer's output received a gradient but its parameters none in the same backward "
                       f"pass, so its per-example norms were never taken; {MICRO_BATCH_HINT}")
        if failure is None and any(p.subset_grads for p in committed):
            failure = ("a measured layer's parameters received no gradient in its backward pass (their whole "
                       "gradient is needed when only some examples are measured); set per_example_max_examples=None")
        self._reset_state()
        if failure is not None:
            raise RuntimeError(f"PerExampleNormTracker: {failure}")
        if any(p.dropped for p in committed):
            return []
        return [p for p in committed if p.sq_norms is not None]

    def pop(self) -> Tensor | None:
        """Per-example squared norms (B,), float32, summed over covered modules and over the backward
        passes since the last pop; None if nothing was measured. Resets. Does not sync the device."""
        passes = self.pop_passes()
        self.last_batch_size = passes[-1].batch_size if passes else None
        if not passes:
            return None
        return torch.stack([p.sq_norms for p in passes]).sum(0) if len(passes) > 1 else passes[0].sq_norms

    def discard(self) -> None:
        """Drop every pass recorded since the last pop, and a failure found in them."""
        self._reset_state()

    def _reset_state(self) -> None:
        self._passes.clear()
        self._model_batches = set()
        self._model_forwards = 0
        self._model_outputs = set()
        self._owner_inputs.clear()  # a forward that raised never reached its post-hook: its nodes are not held on
        self._forward_costs = []
        self._last_subset = None
        self._saw_tracked_forward = False
        self.failure = None

    def _fail(self, reason: str) -> None:
        """Stop measuring: remember why (:meth:`pop_passes` raises it) and make every hook inert."""
        if self.failure is None:
            self.failure = reason

    @staticmethod
    def _fail_pass(record: PassNorms, reason: str) -> None:
        """This pass can't be measured: :meth:`pop_passes` raises it if the pass fills ``.grad`` (a pass of
        ``torch.autograd.grad`` that failed, e.g. on a batch of another size, is dropped like any other)."""
        if record.failure is None:
            record.failure = reason

    # ------------------------------------------------------------------ hooks

    def _listening(self) -> bool:
        return self.enabled and self._attached and self.failure is None

    def _active(self) -> bool:
        return self._listening() and not hooks_inert(pausable=not self.runs_when_paused)

    def _refuses_compiled(self) -> bool:
        """Stop measuring (and say why) when a training forward is being traced by ``torch.compile``
        (:mod:`.compiled`): the compiled graph will never call the hooks."""
        if compiled.tracing() and self._listening() and torch.is_grad_enabled():
            self._fail(f"a training forward ran under torch.compile: {compiled.REASON}.")
            return True
        return False

    @_never_raises
    def _on_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if self._refuses_compiled() or not self._active():
            return
        if not (isinstance(output, Tensor) and output.requires_grad and torch.is_grad_enabled()):
            return
        inp = args[0] if args else kwargs.get("input")
        if not isinstance(inp, Tensor) or self._left_out(module, inp):
            return
        self._saw_tracked_forward = True
        if is_parameter(inp) or (self._table_checks_left > 0 and computed_from_parameters(inp)):
            output.register_hook(partial(self._on_table_call, module))
            return
        saved = inp.detach()
        source = unflattened(module, inp, self.expected_batch_size, self._sequence_first)
        if source is not None:  # (B·T, D) rows viewed from (B, T, D), or Swin's windows: read at that shape
            saved = saved.reshape(source)
        # The hook lives on the output's autograd node, so the saved input is freed with the graph.
        output.register_hook(partial(self._on_output_grad, module, saved))
        covered = self._covered_modules.get(module)
        if self.max_examples is not None and covered is not None and current_pass() < 0:  # not a recomputation
            batch = self.expected_batch_size or inp.shape[0]
            self._forward_costs.append((*covered.cost(module, inp, output, batch), covered.param_count))
            self._forward_launch_cost = launch_cost(output.device)

    @_never_raises
    def _on_alias_forward(self, measured: nn.Module, _alias: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                          output: Any) -> None:
        """A call of an embedding sharing ``measured``'s table: a call of ``measured``."""
        self._on_forward(measured, args, kwargs, output)

    @_never_raises
    def _on_model_forward(self, _model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The examples the model's own forward was given (its inputs' majority dim 0, None where that can't be
        told), kept for :meth:`_rows_are_the_models_examples` while the batch's size is not known."""
        if self._listening() and torch.is_grad_enabled() and self.expected_batch_size is None:
            self._model_batches.add(batch_size_of((*args, kwargs)))
            self._model_forwards += 1

    @_never_raises
    def _on_model_output(self, _model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """The rows the model's own forward returned, where it returned one tensor (a container, such as an RNN's
        ``(output, (h_n, c_n))``, holds other leading dims: none is kept), kept for
        :meth:`_rows_are_the_models_examples` while the batch's size is not known. A time-first output of three or
        more dims whose dim 1 holds the examples read off the inputs (``(T, B, C)``, the layout CTC's ``log_probs``
        take) is the examples' own rows turned: not kept. Before, a digits model on ``(B, 8, 8)`` rows returning
        ``(8, B, 10)`` was stopped in a plain loop ("returned 8"), though measured exactly once told the size."""
        if (self._listening() and torch.is_grad_enabled() and self.expected_batch_size is None
                and isinstance(output, Tensor) and output.ndim > 0):
            if output.ndim >= 3 and output.shape[1] in self._model_batches:
                return
            self._model_outputs.add(output.shape[0])

    def _rows_are_the_models_examples(self, record: PassNorms, rows: int, source: str) -> bool:
        """With the batch's size unknown, a layer's rows must number the examples its model was called on, where one
        number was told: a layer on more or fewer rows (two views of each example stacked as rows, the batch through
        a part of the model in chunks) holds no example per row. Before, a digits MLP run on ``cat([x, x.flip(1)])``
        read B_simple = 43.1 (95% CI 39.2–47.8) against an exact 86.4, in a loop of one's own with no word. Nor are
        they where the model returned fewer rows than its inputs hold: a disjoint union of graphs (node rows in, one
        row per graph out) through layers that all run on nodes read 27.3–29.5 against an exact 155.3, 0 of 5
        intervals holding it (``benchmarks/graph_models.py``, "plain, no check")."""
        if self.expected_batch_size is not None or len(self._model_batches) != 1:
            return True
        (examples,) = self._model_batches
        if examples is None:
            return True
        fewer = sorted(n for n in self._model_outputs if n < examples)
        if rows == examples and fewer:
            self._fail_pass(record,
                f"module '{source}' ran on {rows} rows, the rows of the model's inputs, but the model returned "
                f"{fewer[0]}: its inputs' rows are not its examples (a disjoint union of graphs, nodes in and one "
                "output per graph; a sequence-first (T, B, ...) input pooled to (B, ...)); tell the meter the "
                "batch's size (expect_batch_size(B) before the forward pass, or check_batch(loss_of, batch, "
                "batch_size=B)) to check each layer against it.")
            return False
        if rows == examples:
            return True
        self._fail_pass(record,
            f"module '{source}' ran on {rows} rows, but the model was called on {examples} examples: its rows are not "
            "the examples (stacked views or copies of them, or chunks of the batch); tell the meter the batch's size "
            f"with expect_batch_size before the forward pass to check each layer against it, or {MICRO_BATCH_HINT}.")
        return False

    def _one_forward_of_known_size(self) -> bool:
        """The model's own forward ran once since the last pop, on a number of examples read off its inputs: a layer
        it called several times then ran on that forward's examples at each call (a layer shared across depth, a
        recurrence written out), each call's rows checked against them (:meth:`_rows_are_the_models_examples`), and
        not on chunks of a batch split outside the model."""
        return self._model_forwards == 1 and None not in self._model_batches

    def _pass_record(self) -> PassNorms:
        return self._passes.record(self._passes.current())

    @_never_raises
    def _on_output_grad(self, module: nn.Module, inp: Tensor, grad_output: Tensor) -> None:
        """One call's output gradient: the layer waits for its parameters' gradient, which arrives after every
        call's (:meth:`_measure_calls`), so that a layer applied several times is measured over all its calls
        (:mod:`.repeated`)."""
        found = self._firing(module, grad_output, once=not combinable(module))
        if found is None:
            return
        covered, record = found
        if inp.dim() > grad_output.dim():  # rows of a flattening (:func:`~.layout.unflattened`), read as its input
            grad_output = grad_output.reshape(*inp.shape[:inp.dim() - grad_output.dim() + 1], *grad_output.shape[1:])
        shared = self._shared_table(module, inp)
        if shared is not None:
            return self._fail_pass(record, f"module '{covered.name}' (Embedding): {shared}; or {MICRO_BATCH_HINT}.")
        try:
            if self._layouts.batch_dim(module, inp, self.expected_batch_size, self._sequence_first) == 1:
                inp, grad_output = inp.movedim(1, 0), grad_output.movedim(1, 0)  # (T, B, ...) → (B, T, ...)
        except LayoutError as error:
            return self._fail_pass(record,
                                   f"module '{covered.name}' ({type(module).__name__}): {error}; {MICRO_BATCH_HINT}.")
        if not (self._rows_are_the_models_examples(record, grad_output.shape[0], covered.name)
                and self._check_batch_size(record, grad_output.shape[0], covered.name)):
            return
        record.calls.setdefault(module, []).append((inp, grad_output))

    def _measure_calls(self, record: PassNorms, module: nn.Module) -> None:
        """The norms of ``module``'s calls in this pass, read as one call (:func:`~.repeated.concatenate_calls`; a
        recurrent cell's by :func:`~.cells.cell_sq_norms`), once its parameters' gradient arrives."""
        calls = record.calls.pop(module, None)
        if not calls or record.failure is not None:
            return
        if is_cell(module):
            record.add(cell_sq_norms(calls, self._covered_modules[module].param_names).float())
            return
        if len(calls) > 1 and self.expected_batch_size is None and not self._one_forward_of_known_size():
            record.calls_unsized = record.calls_unsized or self._covered_modules[module].name
        inp, grad_output = concatenate_calls(module, calls)
        self._measure(record, module, self._covered_modules[module], inp, grad_output)
        if module in self._tied:
            record.tied_calls[module] = (inp, grad_output)
            self._add_cross_term(record, module)

    @_never_raises
    def _on_table_call(self, module: nn.Module, grad_output: Tensor) -> None:
        """A layer ran on a learned parameter (a table of class prototypes, say), not on the examples: its rows
        are not examples, and read as a batch (when they happen to number as many) they would give wrong norms."""
        found = self._first_order_record(module, grad_output)
        if found is not None:
            self._fail_pass(found[1], f"module '{found[0].name}' ({type(module).__name__}) ran on a learned parameter "
                                      "(e.g. a table of prototypes), whose rows are not the batch's examples; "
                                      f"{MICRO_BATCH_HINT}.")

    def _first_order_record(self, module: nn.Module,
                            grad_output: Tensor) -> Optional[tuple[_CoveredModule, PassNorms]]:
        """``module``'s entry and this pass's record, or None where nothing is measured: the tracker is inactive or
        the module not covered, a ``create_graph=True`` pass (it stops measuring), a pass that failed already."""
        if not self._active() or module not in self._covered_modules:
            return None
        covered = self._covered_modules[module]
        if grad_output.requires_grad:
            self._fail(
                f"a backward pass with create_graph=True reached '{covered.name}' (e.g. a gradient penalty): the "
                "step's gradient then holds second-order terms that per-example hooks can't see; "
                f"{MICRO_BATCH_HINT}."
            )
            return None
        record = self._pass_record()
        return (covered, record) if record.failure is None else None

    def _firing(self, module: nn.Module, grad_output: Tensor,
                once: bool = True) -> Optional[tuple[_CoveredModule, PassNorms]]:
        """:meth:`_first_order_record`, and the module marked as fired in this pass; with ``once``, None (the pass
        failed) if it fired already: it was applied more than once and its calls can't be read as one."""
        found = self._first_order_record(module, grad_output)
        if found is None:
            return None
        if once and module in found[1].fired:
            return self._fail_applied_twice(found[1], module)
        found[1].fired.add(module)
        return found

    def _fail_applied_twice(self, record: PassNorms, module: nn.Module) -> None:
        self._fail_pass(record,
            f"module '{self._covered_modules[module].name}' ({type(module).__name__}) was applied more than once in "
            "the forward pass and received several output gradients in one backward pass. The per-example norm of "
            "the summed gradient is not the sum of per-call norms, and this layer's calls can't be read as one (those "
            f"of Linear, Embedding, LayerNorm and RMSNorm layers can), so it can't be measured with hooks; "
            f"{MICRO_BATCH_HINT}."
        )

    # ------------------------------------------------------------------ attention modules (:mod:`.attention`)

    @_never_raises
    def _on_attention_start(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._refuses_compiled():
            return
        if self._active() and torch.is_grad_enabled() and module in self._covered_modules:
            batch = attention_batch_size(module, attention_query(args, kwargs))
            on_call = partial(self._on_projection, module, batch)
            capture = ProjectionCalls(module, self._covered_modules[module].param_names, on_call)
            self._captures[module] = capture.__enter__()

    @_never_raises
    def _on_attention_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        capture = self._captures.pop(module, None)
        if capture is not None:
            capture.__exit__(None, None, None)

    @_never_raises
    def _on_projection(self, module: nn.Module, batch: Optional[int], call: ProjectionCall, inp: Tensor,
                       output: Tensor) -> None:
        if output.requires_grad:
            self._saw_tracked_forward = True
            output.register_hook(partial(self._on_projection_grad, module, call, inp.detach(), batch))

    @_never_raises
    def _on_projection_grad(self, module: nn.Module, call: ProjectionCall, inp: Tensor, batch: Optional[int],
                            grad_output: Tensor) -> None:
        """One projection of an attention module: its rows' per-example squared norms join the pass."""
        found = self._first_order_record(module, grad_output)
        if found is None:
            return
        covered, record = found
        keys = {(module, *key) for key in call.keys()}
        if keys & record.fired:
            return self._fail_applied_twice(record, module)
        record.fired.update(keys | {module})
        reason = self._declared_batch_reason(module, batch, "its query")
        if reason is not None:
            return self._fail_declared(record, covered.name, "MultiheadAttention", reason)
        if self._check_batch_size(record, batch, covered.name):
            with _no_grad():
                record.add(projection_sq_norms(call, inp, grad_output, batch).float())

    def _declared_batch_reason(self, module: nn.Module, batch: Optional[int], what: str) -> Optional[str]:
        """Why the examples of ``what`` (the query or input of a module that declares its layout with
        ``batch_first``: attention, recurrent) can't be told, or None."""
        if batch is None:
            return f"{what} is not batched (a 3-D tensor), so its examples can't be told"
        if self.expected_batch_size is not None and batch != self.expected_batch_size:
            layout = "(N, L, E)" if module.batch_first else "(L, N, E)"
            reason = (f"with batch_first={module.batch_first} {what} {layout} holds {batch} examples, but the "
                      f"batch has {self.expected_batch_size}")
            misread = not module.batch_first and batch > self.expected_batch_size  # (T, B, ...) read as T
            return misread_batch_reason(reason) if misread else reason
        return None

    def _fail_declared(self, record: PassNorms, name: str, kind: str, reason: str) -> None:
        """A module that declares its layout can't be measured: ``reason``, and :data:`MICRO_BATCH_HINT` unless the
        batch's size was misread (which ``micro_batch`` would read wrong too)."""
        hint = "" if MISREAD_BATCH_SIZE in reason else f"; {MICRO_BATCH_HINT}"
        self._fail_pass(record, f"module '{name}' ({kind}): {reason}{hint}.")

    # ------------------------------------------------------------------ bag embeddings (:mod:`.embedding_bag`)

    @_never_raises
    def _on_bag_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if self._refuses_compiled() or not self._active():
            return
        if module in self._covered_modules and isinstance(output, Tensor) and output.requires_grad:
            self._saw_tracked_forward = True
            tokens, offsets, weights = (v.detach() if isinstance(v, Tensor) else v for v in bag_inputs(args, kwargs))
            output.register_hook(partial(self._on_bag_grad, module, tokens, offsets, weights))

    @_never_raises
    def _on_bag_grad(self, module: nn.Module, tokens: Tensor, offsets: Optional[Tensor], weights: Optional[Tensor],
                     grad_output: Tensor) -> None:
        """One bag per example: the bags' squared norms join the pass."""
        found = self._firing(module, grad_output)
        if found is None:
            return
        covered, record = found
        bags = grad_output.shape[0]
        if self.expected_batch_size is not None and bags != self.expected_batch_size:
            return self._fail_pass(record, f"module '{covered.name}' (EmbeddingBag) made {bags} bags, but the batch "
                                           f"has {self.expected_batch_size} examples; {MICRO_BATCH_HINT}.")
        if self._check_batch_size(record, bags, covered.name):
            with _no_grad():
                record.add(embedding_bag_sq_norms(module, tokens, offsets, weights, grad_output).float())

    # ------------------------------------------------------------------ recurrent modules (:mod:`.recurrent`)

    def _recurrent_call(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                        outputs: list[tuple[int, Tensor]]) -> Optional[tuple[Any, Optional[Tensor], Any]]:
        """``(input, input detached, state)`` of a recurrent module's or cell's call whose ``outputs`` are watched,
        or None where this call is not measured (inactive, compiled, no gradient, not covered)."""
        if self._refuses_compiled() or not self._active() or not torch.is_grad_enabled():
            return None
        if module not in self._covered_modules or not outputs:
            return None
        self._saw_tracked_forward = True
        inp = args[0] if args else kwargs.get("input")
        hx = args[1] if len(args) > 1 else kwargs.get("hx")
        state = hx if hx is None or isinstance(hx, Tensor) else tuple(hx)
        return inp, (inp.detach() if isinstance(inp, Tensor) else None), state

    @staticmethod
    def _when_all_grads(outputs: list[tuple[int, Tensor]], slots: int, on_grads: Callable[..., None]) -> None:
        """Call ``on_grads(grads)`` once the gradients of every one of ``outputs`` (``(slot, tensor)``) that gets one
        are in: ``grads`` has ``slots`` entries, each output's at its slot, None where none came."""
        def deliver(arrived: Sequence[Optional[Tensor]]) -> None:
            grads: list[Optional[Tensor]] = [None] * slots
            for (slot, _), grad in zip(outputs, arrived):
                grads[slot] = grad
            on_grads(grads)

        torch.autograd.graph.register_multi_grad_hook([tensor for _, tensor in outputs], deliver, mode="all")

    @_never_raises
    def _on_recurrent_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                              output: Any) -> None:
        outputs = _recurrent_outputs(output)
        call = self._recurrent_call(module, args, kwargs, outputs)
        if call is None:
            return
        inp, saved, state = call
        own = outputs[0][1].detach() if outputs[0][0] == 0 and isinstance(output[0], Tensor) else None
        self._when_all_grads(outputs, 3, partial(self._on_recurrent_grads, module, saved, state, own,
                                                 input_reason(module, inp)))

    @_never_raises
    def _on_recurrent_grads(self, module: nn.Module, inp: Optional[Tensor], hx: Any, output: Optional[Tensor],
                            reason: Optional[str], grads: list[Optional[Tensor]]) -> None:
        """A recurrent module's output gradients (``output``, ``h_n``, ``c_n``; None where none came) are all in: its
        per-example squared norms join the pass (recomputed, :func:`~.recurrent.recurrent_sq_norms`; ``output``:
        the forward's own)."""
        arrived = [grad for grad in grads if grad is not None]
        found = self._firing(module, arrived[0]) if arrived else None
        if found is None:
            return
        covered, record = found
        batch = None if reason is not None else recurrent_batch_size(module, inp)
        reason = reason or self._declared_batch_reason(module, batch, "its input")
        if reason is not None:
            return self._fail_declared(record, covered.name, type(module).__name__, reason)
        if self._check_batch_size(record, batch, covered.name):
            record.add(recurrent_sq_norms(module, inp, hx, grads, covered.param_names, output).float())

    # ------------------------------------------------------------------ recurrent cells (:mod:`.cells`)

    @_never_raises
    def _on_cell_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                         output: Any) -> None:
        outputs = cell_outputs(output)
        call = self._recurrent_call(module, args, kwargs, outputs)
        if call is None:
            return
        inp, saved, state = call
        self._when_all_grads(outputs, 2, partial(self._on_cell_grads, module, saved, state,
                                                 state_feeds_output(output), cell_input_reason(inp)))

    @_never_raises
    def _on_cell_grads(self, module: nn.Module, inp: Optional[Tensor], hx: Any, state_grad_is_total: bool,
                       reason: Optional[str], grads: list[Optional[Tensor]]) -> None:
        """One call's output gradients (``h``, and ``c`` for LSTM; None where none came) are in: its gates' gradients
        wait with the pass's other calls of ``module`` for its parameters' gradient (:meth:`_measure_calls`)."""
        arrived = [grad for grad in grads if grad is not None]
        found = self._firing(module, arrived[0], once=False) if arrived else None
        if found is None:
            return
        covered, record = found
        if reason is None and self.expected_batch_size is not None and inp.shape[0] != self.expected_batch_size:
            reason = f"its input holds {inp.shape[0]} rows, but the batch has {self.expected_batch_size} examples"
        if reason is not None:
            return self._fail_pass(record, f"module '{covered.name}' ({type(module).__name__}): {reason}; "
                                           f"{MICRO_BATCH_HINT}.")
        if self._check_batch_size(record, inp.shape[0], covered.name):
            record.calls.setdefault(module, []).append(cell_call(module, inp, hx, grads, state_grad_is_total))

    def _add_cross_term(self, record: PassNorms, module: nn.Module) -> None:
        """A tied table's ``2⟨E_i, H_i⟩`` (:mod:`.tied`), once both of its modules' calls are measured: the
        embedding's lookups over all their calls (aliases included) against the head's."""
        partner = self._tied[module]
        if partner not in record.tied_calls:
            return
        embedding, head = (module, partner) if isinstance(module, nn.Embedding) else (partner, module)
        (tokens, lookup_grad), (inp, grad_output) = record.tied_calls.pop(embedding), record.tied_calls.pop(head)
        with _no_grad():
            record.add(cross_term(embedding, tokens, lookup_grad, logits_at_tokens(tokens, inp, grad_output)).float())

    def _left_out(self, module: nn.Module, inp: Tensor) -> bool:
        """Whether ``module`` is no longer measured as a layer: an embedding found, at its first forward, to be a
        position table shared by every example (:func:`~.embedding.shared_table_reason`) is read from then on
        where its rows are broadcast over the batch, as a bare parameter of the module that calls it
        (:meth:`_adopt_shared_table`); where no such module can be told, it is left out of both norms while the
        rest keeps :data:`MIN_COVERAGE` of the trainable parameters (else its backward fails the pass with the
        reason and the fix)."""
        if module not in self._covered_modules:
            return True
        if isinstance(module, nn.Embedding) and module not in self._shared_tables and module not in self._tied:
            reason = self._shared_table(module, inp)
            if reason is not None and self._adopt_shared_table(module, reason):
                return True
            if reason is not None and self._coverage_without(module) >= MIN_COVERAGE:
                self._exclude(module, reason)
                return True
        return False

    def _adopt_shared_table(self, module: nn.Module, reason: str) -> bool:
        """Hand a shared position table over to the bare parameters (:mod:`.broadcast`: its lookup is a view,
        :data:`~.param_path.LOOKUPS`), owned by the module whose forward calls it (:meth:`_find_table_callers`,
        hooked at attach, so its first pass is read). False where it has none."""
        owner = self._table_callers.get(module)
        if owner is None:
            return False
        self._make_bare(module, owner, f"{reason} (read where its rows are broadcast over the batch)")
        return True

    def _make_bare(self, module: nn.Module, owner: nn.Module, reason: str) -> str:
        """Move ``module``'s covered parameters to the bare parameters of ``owner``, left out with ``reason`` until
        their uses are read; returns the module's name."""
        moved = self._covered_params_of(module)
        name = self._covered_modules.pop(module).name
        self._leave_out(moved, reason)
        for param_name, param in moved:
            bare = _BareParameter(param_name, param, (owner,))
            self._bare[id(param)] = bare
            self._handles.append(param.register_hook(OwnHook(partial(self._on_bare_grad, bare))))
        return name

    def _to_caller(self, module: nn.Module, caller: nn.Module, reason: str) -> None:
        """Move ``module``'s parameters from covered to bare parameters of ``caller`` (hooked now, if it was not),
        and say so once."""
        hooked = {id(owner) for bare in self._bare.values() for owner in bare.owners}
        hooked |= {id(m) for m in [*self._table_callers.values(), *self._bare_callers.values()]}
        name = self._make_bare(module, caller, reason)
        if id(caller) not in hooked:
            self._handles += [caller.register_forward_pre_hook(OwnHook(self._before_owner_forward), with_kwargs=True),
                              caller.register_forward_hook(OwnHook(self._on_owner_forward))]
        warnings.warn(f"gns_callback: the parameters of '{name}' are used outside its forward; from the next step on "
                      "they are read where the module that calls it uses them, or left out with the reason (this "
                      "step is not measured).", stacklevel=2)

    def _find_table_callers(self, parents: dict[int, nn.Module]) -> dict[nn.Module, nn.Module]:
        """Per measured embedding, the module whose forward presumably calls it (:func:`_calling_module`): the
        owner it would have as a shared position table."""
        return {m: caller for m in self._covered_modules if type(m) is nn.Embedding and m not in self._tied
                and (caller := _calling_module(parents, m)) is not None}

    def _find_bare_callers(self, parents: dict[int, nn.Module]) -> dict[nn.Module, nn.Module]:
        """Per module holding bare parameters, the module whose forward presumably calls it (:func:`_calling_module`):
        their owner should its forward return one as it is (:meth:`_hand_over`)."""
        owners = {id(owner): owner for bare in self._bare.values() for owner in bare.owners}
        return {owner: caller for owner in owners.values() if (caller := _calling_module(parents, owner)) is not None}

    def _covered_params_of(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """``(qualified name, parameter)`` of the covered parameters that ``module`` owns."""
        ids = {id(module.get_parameter(name)) for name in self._covered_modules[module].param_names}
        return [(name, p) for name, p in self._covered_params if id(p) in ids]

    def _coverage_without(self, module: nn.Module) -> float:
        """:meth:`coverage_fraction` once ``module``'s parameters are left out."""
        return self.coverage_fraction() - self._share(sum(p.numel() for _, p in self._covered_params_of(module)))

    def _exclude(self, module: nn.Module, reason: str) -> None:
        """Move ``module``'s parameters from covered to left out (with ``reason``), and say so once."""
        moved = self._covered_params_of(module)
        covered = self._covered_modules.pop(module)
        self._leave_out(moved, reason)
        warnings.warn(
            f"gns_callback left the embedding '{covered.name}' ({sum(p.numel() for _, p in moved)} parameters) out "
            f"of both norms: {reason}. The noise scale now covers {self.coverage_fraction():.1%} of the trainable "
            "parameters (the report's coverage lists what is left out).", stacklevel=2)

    def _leave_out(self, params: list[tuple[str, nn.Parameter]], reason: str) -> None:
        """Move ``params`` (qualified name, parameter) from covered to left out, with ``reason``."""
        ids = {id(p) for _, p in params}
        self._covered_params = [(name, p) for name, p in self._covered_params if id(p) not in ids]
        self._uncovered_params += params
        for name, _ in params:
            self.excluded_reasons[name] = reason

    def _shared_table(self, module: nn.Module, inp: Tensor) -> Optional[str]:
        """:func:`~.embedding.shared_table_reason` for an embedding, checked on its first pass only (one compare,
        one device sync) and remembered."""
        if not isinstance(module, nn.Embedding):
            return None
        if module not in self._shared_tables:
            self._shared_tables[module] = shared_table_reason(inp, self.expected_batch_size)
        return self._shared_tables[module]

    def _measure(self, record: PassNorms, module: nn.Module, covered: _CoveredModule, inp: Tensor,
                 grad_output: Tensor) -> None:
        """Add ``module``'s per-example squared norms (batch in dim 0 by now) to the pass."""
        every = (inp, grad_output)
        subset = self._measures_subset(record, grad_output.shape[0])
        if subset:
            inp, grad_output = inp[: self.max_examples], grad_output[: self.max_examples]
        with _no_grad():
            sq_norms = covered.sq_norms(module, inp, grad_output, param_names=covered.param_names)
            if subset:
                summed = covered.summed_grads(module, inp, grad_output, param_names=covered.param_names)
                record.subset_grads.update({_qualified(covered.name, k): v for k, v in summed.items()})
        if self.sum_check is not None:
            self.sum_check.add_call(module, covered.summed_grads, covered.param_names, *every,
                                    float(sq_norms.sum()) * every[1].shape[0] / sq_norms.shape[0])
        record.add(sq_norms.float())

    def _measures_subset(self, record: PassNorms, batch_size: int) -> bool:
        """Whether this pass measures only the first ``max_examples`` examples: decided once per pass, when the
        layers seen in the forward passes since the last decision say it is cheaper (:mod:`.cost`). A pass with no
        forward since the last decision (a reentrant checkpoint's segment recorded apart from its outer pass, whose
        recomputed forward runs inside backward and is not counted) takes the last decision, so that the two
        records agree when they are merged (:meth:`PassNorms.merged`)."""
        if record.subset is None:
            costs, self._forward_costs = self._forward_costs, []
            if costs or self._last_subset is None:
                self._last_subset = (self.max_examples is not None and batch_size > self.max_examples
                                     and self._subset_allowed and subset_is_cheaper(
                                         costs, batch_size, self.max_examples, self._forward_launch_cost))
            record.subset = self._last_subset
        return record.subset

    @_never_raises
    def _on_param_grad(self, modules: tuple[nn.Module, ...], param_name: str, param_id: int, local_name: str,
                       grad: Tensor) -> None:
        """``modules``: the parameter's module, or both modules of a tied table."""
        if not self._active() or not any(m in self._covered_modules for m in modules):
            return
        record = self._pass_record()
        param = _own_parameter(modules[0], local_name)
        if id(param) != param_id:
            return self._fail_pass(record, _replaced_reason(param_name))
        for module in modules:
            self._measure_calls(record, module)
        if self.sum_check is not None:
            self.sum_check.compare(param_name, param_id, grad, record.batch_size or 1, param)
        if param_name in record.subset_grads:
            with _no_grad():
                record.add_unmeasured(param_name, grad)
        if record.failure is None and not any(m in record.fired for m in modules):
            self._used_elsewhere(record, modules, param_name)

    def _used_elsewhere(self, record: PassNorms, modules: tuple[nn.Module, ...], param_name: str) -> None:
        """A parameter's gradient came without its module's output gradient. Where the model's layers were seen run,
        the parameter is used outside its module's forward (Mamba's ``dt_proj.weight @ x``): the module's parameters
        become bare parameters of the module that calls it, read at their products and broadcasts from the next
        step on (or left out with the reason, as any bare parameter), and this pass's step is not measured. The pass
        fails instead where no caller can be told."""
        reason = self._unseen_output_reason(param_name)
        caller = _calling_module(_parents(self.model), modules[0]) if len(modules) == 1 else None
        if not self._saw_tracked_forward or caller is None:
            return self._fail_pass(record, reason)
        self._to_caller(modules[0], caller, reason)
        record.dropped = True

    def _unseen_output_reason(self, param_name: str) -> str:
        """Why a parameter's gradient came without its module's output gradient: the module ran outside its hooks'
        sight (no tracked forward at all since the last pop), or the parameter was used outside its module."""
        if not self._saw_tracked_forward:
            return (f"parameter '{param_name}' received a gradient, but the per-example hooks saw no forward of the "
                    "model's layers: the forward ran where module hooks don't, e.g. a graph compiled by torch.compile "
                    f"before the hooks were attached; {compiled.REASON}")
        return (f"parameter '{param_name}' received a gradient that did not flow through its module's output: it is "
                "used outside the module's forward (e.g. F.linear(x, module.weight), or a positional table indexed "
                f"directly), so its per-example norm can't be measured; {MICRO_BATCH_HINT}.")

    # ------------------------------------------------------------------ bare parameters (:mod:`.broadcast`)

    def _bare_hooks(self) -> list[RemovableHandle]:
        """Forward pre-hooks and hooks on each module holding bare parameters or calling an embedding (which may
        turn out to be a shared position table), and a gradient hook on each bare parameter."""
        owners = {id(owner): owner for bare in self._bare.values() for owner in bare.owners}
        owners.update({id(caller): caller for caller in [*self._table_callers.values(), *self._bare_callers.values()]})
        return ([owner.register_forward_pre_hook(OwnHook(self._before_owner_forward), with_kwargs=True)
                 for owner in owners.values()]
                + [owner.register_forward_hook(OwnHook(self._on_owner_forward)) for owner in owners.values()]
                + [bare.param.register_hook(OwnHook(partial(self._on_bare_grad, bare)))
                   for bare in self._bare.values()])

    @_never_raises
    def _before_owner_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The graph made before this forward (its inputs' nodes, taken before it may change them in place):
        where the walk for its bare parameters' uses stops."""
        if compiled.tracing():  # the post-hook refuses the compiled forward (:meth:`_refuses_compiled`)
            return
        nodes = [t.grad_fn for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor) and t.grad_fn is not None]
        self._owner_inputs.setdefault(module, []).append(nodes)

    @_never_raises
    def _on_owner_forward(self, module: nn.Module, _inputs: tuple[Any, ...], output: Any) -> None:
        """Find where this forward broadcast the module's bare parameters, and hook those nodes."""
        running = self._owner_inputs.get(module)
        stop_at = running.pop() if running else []
        if self._refuses_compiled() or not self._active() or not torch.is_grad_enabled():
            return
        bare = {key: b.param for key, b in self._bare.items() if b.owned_by(module) and b.refused is None}
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.requires_grad]
        bare = self._hand_over(module, outputs, bare)
        if not bare or not outputs:
            return
        consumers, unread = find_consumers(outputs, bare, stop_at)
        for key, kind in unread.items():
            self._refuse(self._bare[key], f"it is used through {kind}, where its per-example gradients are not read")
        for consumer in consumers:
            # Marked in the node's own metadata (no reference to the graph is kept): a later call's walk may
            # pass through this call's graph again.
            mark = ("gns_callback.bare", id(self), id(consumer.node), consumer.index)
            if not consumer.hooked.metadata.get(mark):
                consumer.hooked.metadata[mark] = True
                consumer.hooked.register_prehook(partial(self._on_consumer_grad, consumer))

    def _hand_over(self, module: nn.Module, outputs: list[Tensor], bare: dict[int, Tensor]) -> dict[int, Tensor]:
        """``bare`` less the parameters that ``module``'s forward returns as they are (:func:`caller_reads`): each is
        handed over to the module that called it, whose own forward hook, later in this forward, reads it."""
        caller = self._bare_callers.get(module)
        for output in outputs if caller is not None else ():
            path = caller_reads(output.grad_fn, bare, self.expected_batch_size, self._sequence_first)
            if path is not None:
                handed = self._bare[id(path.param)]
                handed.owners = tuple(caller if owner is module else owner for owner in handed.owners)
                bare = {key: param for key, param in bare.items() if param is not path.param}
        return bare

    @_never_raises
    def _on_consumer_grad(self, consumer: Consumer, grad_outputs: tuple[Optional[Tensor], ...]) -> None:
        """The examples' gradients of a bare parameter at one of its broadcasts, kept until its gradient comes."""
        bare, grad_output = self._bare.get(id(consumer.param)), grad_outputs[0]
        if bare is None or bare.refused or grad_output is None or grad_output.requires_grad or not self._active():
            return
        record = self._pass_record()
        if record.failure is not None:
            return
        dim = examples_dim(consumer, grad_output, self.expected_batch_size, self._sequence_first,
                           computed_tables=self._table_checks_left > 0)
        if dim is None and consumer.dual:
            return  # read by its other reading, or by neither (then refused when its gradient comes)
        rows_each = 1 if dim is not None else rows_per_example(consumer, grad_output, self.expected_batch_size,
                                                               self._sequence_first)
        if dim is None and rows_each == 1:
            return self._refuse(bare, f"{type(consumer.node).__name__} takes it along no dim of the batch's "
                                      "examples that can be told")
        with _no_grad():
            found = example_grads(consumer, grad_output, dim or 0, rows_each)
        kept = record.products if isinstance(found, Factors) else record.broadcast
        before = kept.get(bare.name)
        if before is not None and before.examples != found.examples:
            return self._refuse(bare, "its uses in one pass saw batches of different sizes")
        if before is not None and type(before) is not type(found):
            return self._refuse(bare, "it is both looked up at the examples' indices and broadcast over them")
        with _no_grad():
            kept[bare.name] = found if before is None else before.joined(found)
        if grad_output.dtype in (torch.float16, torch.bfloat16):
            record.half_inputs.add(bare.name)

    @_never_raises
    def _on_bare_grad(self, bare: _BareParameter, grad: Tensor) -> None:
        """A bare parameter's whole gradient of the pass: on its first pass, the check that its examples'
        gradients add up to it (else it stays left out); then their squared norms join the pass's."""
        if bare.refused or not self._active():
            return
        record = self._pass_record()
        if record.dropped:  # a layer was handed over to bare parameters during this pass: the next pass decides
            return
        found = self._bare_example_grads(bare, record)
        if record.failure is not None or found is None:
            return
        if not bare.measured:
            with _no_grad():
                verdict = adds_up_to(found.summed(), grad, half_inputs=bare.name in record.half_inputs)
            if verdict is None:  # an overflow step a gradient scaler skips: the next pass decides
                return
            if not verdict:
                return self._refuse(bare, "its examples' gradients at its broadcasts and products do not add up to "
                                          "its gradient (it is used elsewhere too)")
            self._promote(bare)
        if self._check_batch_size(record, found.examples, bare.name):
            self._add_bare_norms(record, found, grad)

    def _bare_example_grads(self, bare: _BareParameter, record: PassNorms) -> Optional[ExampleGrads]:
        """The pass's per-example gradients of ``bare``: rows (B, numel), or a matrix product's factors where it
        was used at products alone; None (and ``bare`` left out) where they were not read."""
        rows, factors = record.broadcast.pop(bare.name, None), record.products.pop(bare.name, None)
        if rows is None and factors is None:
            return self._refuse(bare, "its gradient came without passing through a broadcast the hooks saw")
        if rows is None or factors is None:
            return factors if rows is None else rows
        if factors.examples != rows.examples:
            return self._refuse(bare, "its uses in one pass saw batches of different sizes")
        if isinstance(rows, LookupGrads):
            return TiedGrads(rows, factors)
        if rows.values.numel() > MAX_ROWS_ELEMENTS:
            return self._refuse(bare, f"its per-example gradients, used at both broadcasts and products, would take "
                                      f"{rows.examples} × {rows.values.shape[1]} elements, more than "
                                      f"{MAX_ROWS_ELEMENTS} are held")
        with _no_grad():
            return rows.joined(Rows(factors.rows()))

    def _add_bare_norms(self, record: PassNorms, found: ExampleGrads, grad: Tensor) -> None:
        """``|g_i|²`` of the measured examples; with a subset, ``|Σ_{i unmeasured} g_i|²`` too."""
        with _no_grad():
            if self._measures_subset(record, found.examples):
                found = found.first(self.max_examples)
                rest = squared_norm(grad.detach().float().reshape(-1) - found.summed())
                record.unmeasured_sq = rest if record.unmeasured_sq is None else record.unmeasured_sq + rest
            record.add(found.sq_norms())

    def _promote(self, bare: _BareParameter) -> None:
        """From left out to measured."""
        bare.measured = True
        self._uncovered_params = [(n, p) for n, p in self._uncovered_params if p is not bare.param]
        self._covered_params.append((bare.name, bare.param))
        self.excluded_reasons.pop(bare.name, None)

    def _refuse(self, bare: _BareParameter, reason: str) -> None:
        """Leave ``bare`` out for good; if it was measured, move it back and say so once."""
        if bare.refused is not None:
            return
        counted_on = self.coverage_fraction() + self.bare_parameter_fraction() >= MIN_COVERAGE
        bare.refused = reason
        if not self._covered_params and all(b.refused is not None for b in self._bare.values()):
            self._fail(f"every trainable parameter is left out of the per-example norms (the last, '{bare.name}': "
                       f"{reason}); {MICRO_BATCH_HINT}.")
        if not bare.measured:
            self.excluded_reasons[bare.name] += f"; as a bare parameter: {reason}"
            if counted_on and self.coverage_fraction() + self.bare_parameter_fraction() < MIN_COVERAGE:
                warnings.warn(f"gns_callback left the bare parameter '{bare.name}' out: {reason}. Per-example norms "
                              f"cover {self.coverage_fraction():.1%} of the trainable parameters: B_simple is that "
                              "of the covered parameters; for the whole model use method='micro_batch'.",
                              stacklevel=2)
            return
        bare.measured = False
        self._leave_out([(bare.name, bare.param)], f"a bare parameter of {type(bare.owners[0]).__name__}: {reason}")
        warnings.warn(f"gns_callback left the parameter '{bare.name}' out of both norms from now on: {reason}. The "
                      f"noise scale now covers {self.coverage_fraction():.1%} of the trainable parameters.",
                      stacklevel=2)

    def _check_batch_size(self, record: PassNorms, batch_size: int, source: str) -> bool:
        if record.batch_size is None:
            record.batch_size, record.source = batch_size, source
        elif batch_size != record.batch_size:
            self._fail_pass(record,
                f"module '{source}' saw batch size {batch_size} but '{record.source}' saw {record.batch_size} in "
                "dim 0 (the micro-batch's size was not known beforehand to tell which dim holds it); "
                f"{MICRO_BATCH_HINT}."
            )
            return False
        return True
