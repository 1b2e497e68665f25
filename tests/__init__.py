"""The test suite (see README: ``python3 -m pytest``)."""

import atexit


def _destroy_process_group() -> None:
    """At the exit of any process that imported the tests (pytest itself, a ``ddp_spawn`` worker unpickling a test
    module, a rank of a ``strategy="ddp"`` script): destroy a process group left up. Lightning does that at exit for
    nccl only; a process that exits with a gloo group up can abort in the interpreter's finalization ("terminate called
    without an active exception", SIGABRT), with or without the callback. CI failed on it twice, both times in a
    baseline fit without the callback (a ddp script's rank 0, a ddp_spawn worker)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(_destroy_process_group)
