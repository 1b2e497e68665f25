"""``torch.compile`` and the per-example hooks: why a compiled forward can't be measured, and how to tell one.

The tracker (:mod:`.tracker`) registers a tensor hook on each layer's output from inside the layer's forward hook.
When ``torch.compile`` traces a forward, those forward hooks run once, at trace time, on placeholder tensors, and
the compiled graph never calls them again: no output hook is registered and no per-example norm is ever computed.
The step would silently go unmeasured. ``micro_batch``'s parameter hooks fire after the compiled backward, as in
eager mode, and measure a compiled model exactly as an eager one.

Two ways to notice it, both here: before training, a submodule wrapped by ``torch.compile`` or compiled in place
(:func:`compiled_modules`); during training, a forward hook that finds itself being traced (:func:`tracing`), for
what no inspection of the model shows (a compiled function called inside ``forward``).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

#: Why per-example norms can't measure a compiled model, and the way out; completed by :func:`problem`.
REASON = (
    "per-example norms come from hooks on each layer's output, which torch.compile traces once and its compiled graph "
    "never calls (leave torch.compile off while measuring per-example norms; method='micro_batch' measures a "
    "compiled model)"
)


def compiled_modules(model: nn.Module) -> list[str]:
    """Names (``''``: ``model`` itself) of the submodules wrapped by ``torch.compile(module)`` or compiled in place
    by ``module.compile()``."""
    optimized = _optimized_module_type()
    return [
        name for name, module in model.named_modules()
        if (optimized is not None and isinstance(module, optimized))
        or getattr(module, "_compiled_call_impl", None) is not None
    ]


def problem(model: nn.Module, compiled: bool = False) -> str | None:
    """Why per-example norms can't measure ``model`` because of ``torch.compile``, or None. ``compiled``: the caller
    knows the forward runs compiled (e.g. a training framework compiled the whole model)."""
    names = compiled_modules(model)
    if not names and not compiled:
        return None
    where = f" ({', '.join(repr(n or type(model).__name__) for n in names[:3])})" if names else ""
    return f"the model is compiled with torch.compile{where}: {REASON}"


def tracing() -> bool:
    """Whether ``torch.compile`` is tracing the code that calls this (a forward hook being traced into a graph)."""
    return torch.compiler.is_compiling()


def _optimized_module_type() -> type | None:
    """``torch.compile(module)``'s wrapper class, or None when nothing can have been compiled yet (``torch.compile``
    imports ``torch._dynamo``; ``import torch`` alone does not, and importing it costs about a second)."""
    if "torch._dynamo" not in sys.modules:
        return None
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule
