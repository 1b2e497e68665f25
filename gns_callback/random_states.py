"""The random number generators' states, to put back after work that must leave the run's random streams as they
were (a probe step), or to draw the same numbers twice (the two passes of :mod:`gns_callback.per_example.coupling`).
Torch only, no Lightning."""

from __future__ import annotations

import random

import numpy as np
import torch


class RNGState:
    """torch (CPU and every initialised CUDA device), numpy and Python ``random`` generator states."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.numpy = np.random.get_state()
        self.python = random.getstate()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        np.random.set_state(self.numpy)
        random.setstate(self.python)
