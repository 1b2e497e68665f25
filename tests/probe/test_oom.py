"""OOM detection over real allocator messages; everything else is not an OOM."""

import pytest
import torch

from gns_callback.probe import is_oom
from gns_callback.probe.oom import short_message

OOM = [
    RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 13.1 GiB already allocated)"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:114] data. DefaultCPUAllocator: not enough memory: you tried to allocate 1099511627776 bytes."),
    RuntimeError("[enforce fail at CPUAllocator.cpp:68] . DefaultCPUAllocator: can't allocate memory: you tried to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)"),
    RuntimeError("MPS backend out of memory (MPS allocated: 1.2 GB, other allocations: 3 MB, max allowed: 1.2 GB)."),
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    MemoryError(),
]

NOT_OOM = [
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."),
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x64 and 32x10)"),
    RuntimeError("Expected more than 1 value per channel when training, got input size torch.Size([1, 32])"),
    ValueError("CUDA out of memory"),  # the message alone is not enough: allocators raise RuntimeError
    KeyError("out of memory"),
    RuntimeError(),
]


@pytest.mark.parametrize("exc", OOM, ids=lambda e: short_message(e, 40))
def test_out_of_memory_errors_are_recognised(exc):
    assert is_oom(exc)


@pytest.mark.parametrize("exc", NOT_OOM, ids=lambda e: short_message(e, 40))
def test_other_errors_are_not(exc):
    assert not is_oom(exc)


def test_an_error_raised_from_an_oom_counts():
    try:
        try:
            raise RuntimeError("CUDA out of memory. Tried to allocate 8.00 MiB")
        except RuntimeError as oom:
            raise ValueError("step failed") from oom
    except ValueError as wrapped:
        assert is_oom(wrapped)


def test_a_real_cpu_allocation_failure_is_an_oom():
    try:
        torch.empty(2**62, dtype=torch.uint8)
    except RuntimeError as exc:
        assert is_oom(exc), str(exc)
    else:  # pragma: no cover - an allocator that lazily over-commits 4 EiB
        pytest.skip("allocation unexpectedly succeeded")


def test_short_message_is_one_line_and_bounded():
    assert short_message(RuntimeError("CUDA out of memory.\nmore")) == "RuntimeError: CUDA out of memory."
    text = short_message(RuntimeError("CUDA out of memory. " + "x" * 500), limit=50)
    assert len(text) == 50 and text.startswith("RuntimeError: CUDA out of memory.") and text.endswith("…")
