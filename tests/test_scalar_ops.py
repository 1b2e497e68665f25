"""HOST and TORCH scalar operations agree, nan and division by zero included."""

import math
import warnings

import numpy as np
import pytest
import torch

from gns_callback.scalar_ops import HOST, TORCH, host_errors_ignored

VALUES = [-2.5, -0.0, 0.0, 0.3, 1.0, 7.0, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("x", VALUES)
def test_clamps_and_isfinite_agree(x):
    t, h = torch.tensor(x, dtype=torch.float64), np.float64(x)
    for name, args in [("clamp_min", (1e-300,)), ("clamp_min", (0.0,)), ("clamp", (0.0, 1.0))]:
        expected = getattr(TORCH, name)(t, *args).item()
        got = float(getattr(HOST, name)(h, *args))
        assert got == expected or (math.isnan(got) and math.isnan(expected)), (name, x)
    assert HOST.isfinite(h) == TORCH.isfinite(t).item()


def test_where_picks_as_torch_where():
    a, b = torch.tensor(1.5, dtype=torch.float64), torch.tensor(-2.0, dtype=torch.float64)
    for cond in (True, False):
        assert HOST.where(cond, 1.5, -2.0) == TORCH.where(torch.tensor(cond), a, b).item()


def test_host_division_by_zero_is_inf_and_nan_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with host_errors_ignored():
            assert np.float64(1.0) / np.float64(0.0) == math.inf
            assert math.isnan(np.float64(0.0) / np.float64(0.0))
            assert 1.0 / np.float64(-0.0) == -math.inf
