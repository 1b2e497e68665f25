"""Is this exception an out-of-memory error? (The probe retries smaller sizes on these, re-raises the rest.)

Allocators report OOM as ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``; a ``RuntimeError``
subclass), as a plain ``RuntimeError`` whose message names the failure (cuDNN/cuBLAS workspaces, the CPU
allocator, older builds), or as Python's ``MemoryError``. Lightning's ``BatchSizeFinder`` matches messages
the same way (``pytorch_lightning/utilities/memory.py``); unlike it, ``CUDNN_STATUS_NOT_SUPPORTED`` is *not*
treated as OOM here: its message blames a non-contiguous input, and retrying smaller would hide a real bug.
"""

from __future__ import annotations

import torch

#: Substrings (lower case) of OOM messages from PyTorch's allocators and libraries.
OOM_MESSAGES: tuple[str, ...] = (
    "cuda out of memory",  # CUDA caching allocator (older builds raise RuntimeError)
    "cuda error: out of memory",  # CUDA runtime, e.g. during context creation or in a kernel launch
    "cudnn_status_alloc_failed",  # cuDNN workspace allocation
    "cublas_status_alloc_failed",  # cuBLAS handle/workspace allocation
    "hip out of memory",  # ROCm
    "hip error: out of memory",
    "mps backend out of memory",  # Apple MPS
    "xpu out of memory",  # Intel XPU
    "defaultcpuallocator: can't allocate memory",  # CPU allocator (posix_memalign failed)
    "not enough memory",  # CPU allocator: "DefaultCPUAllocator: not enough memory: you tried to allocate ..."
)

_OOM_TYPES: tuple[type[BaseException], ...] = tuple(
    t for t in (getattr(torch, "OutOfMemoryError", None), getattr(torch.cuda, "OutOfMemoryError", None)) if t
)


def is_oom(exc: BaseException) -> bool:
    """True for out-of-memory errors, also when re-raised ``from`` one (``raise X from oom``); else False."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MemoryError) or (_OOM_TYPES and isinstance(exc, _OOM_TYPES)):
            return True
        if isinstance(exc, RuntimeError) and exc.args:
            message = str(exc.args[0]).lower()
            if any(pattern in message for pattern in OOM_MESSAGES):
                return True
        exc, seen = exc.__cause__, seen + 1
    return False


def short_message(exc: BaseException, limit: int = 160) -> str:
    """``"RuntimeError: CUDA out of memory. Tried to ..."`` cut to ``limit`` characters (for the trial log)."""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
