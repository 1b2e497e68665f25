"""The byte accounting: unique storages, saved-for-backward tensors, parameters, gradients, optimizer state."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from gns_callback.probe.accounting import OverBudget, SavedTensorsMeter, static_bytes, storage_of, unique_bytes


def test_views_of_one_storage_count_once():
    x = torch.zeros(10, 8)
    assert unique_bytes([x, x.t(), x[2:5], x.view(80)]) == 320
    assert unique_bytes([x, torch.zeros(3)]) == 332
    assert storage_of(torch.empty(0)) is None


def test_saved_tensors_are_counted_once_even_if_saved_twice():
    x = torch.randn(16, 8, requires_grad=True)
    with SavedTensorsMeter() as meter:
        y = x * x  # mul saves both operands: the same storage
    assert meter.saved_bytes == 16 * 8 * 4
    with SavedTensorsMeter() as meter:
        z = torch.tanh(x).sum()  # tanh saves its output
    assert meter.saved_bytes == 16 * 8 * 4
    del y, z


def test_parameters_are_left_to_static_bytes():
    lin = nn.Linear(8, 4)
    exclude = {storage_of(p)[0] for p in lin.parameters()}
    x = torch.randn(5, 8)
    with SavedTensorsMeter(exclude=exclude) as meter:
        loss = lin(x).sum()  # addmm saves the input and weight.t() (a view of the weight)
    assert meter.saved_bytes == x.numel() * 4
    loss.backward()


def test_peak_not_sum_when_autograd_releases_saved_tensors():
    """Per-chunk backward (batch_split_factor, checkpointing) frees saved tensors: the peak is one chunk's."""
    w = torch.randn(64, requires_grad=True)
    chunk_bytes = 8 * 64 * 4
    with SavedTensorsMeter() as meter:
        for _ in range(4):
            h = torch.randn(8, 1) * w  # saves the (8, 1) factor (for w's gradient)
            torch.tanh(h).sum().backward()  # tanh saves an (8, 64) output, freed by this backward
    assert chunk_bytes <= meter.saved_bytes < 2 * chunk_bytes
    assert meter.live_bytes == 0


def test_abort_above_raises_a_simulated_oom_inside_forward():
    x = torch.randn(100, 100, requires_grad=True)
    with pytest.raises(OverBudget):
        with SavedTensorsMeter(abort_above=1000):
            torch.tanh(x)


def test_static_bytes_include_gradients_and_lazily_created_adam_state():
    net = nn.Linear(10, 3)
    param_bytes = sum(p.numel() * 4 for p in net.parameters())
    opt = torch.optim.Adam(net.parameters())
    assert static_bytes(list(net.parameters()), [opt]) == param_bytes
    F.mse_loss(net(torch.randn(4, 10)), torch.zeros(4, 3)).backward()
    assert static_bytes(list(net.parameters()), [opt]) == 2 * param_bytes
    opt.step()
    steps = sum(state["step"].numel() * state["step"].element_size() for state in opt.state.values())
    assert static_bytes(list(net.parameters()), [opt]) == 4 * param_bytes + steps  # + exp_avg, exp_avg_sq
