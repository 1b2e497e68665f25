"""Rows that each hold a part of one example, example by example (Swin's windows, ``(B·nW, T, C)``): which layouts
the walk back through the graph proves example-major, and which it does not; a Swin-style model measured whole
against ``torch.func``; windows stacked in another order refused, never read as examples."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gns_callback.per_example import PerExampleNormTracker
from gns_callback.per_example.window_rows import example_major_rows
from tests.trust.models import (FusedWindowAttention, KernelWindowAttention, SwinStyle, WindowAttention, unwindowed,
                               windows)

B = 3


def _maps() -> tuple[torch.Tensor, nn.Linear, nn.Parameter]:
    """Feature maps ``(B, 4, 4, 6)`` made by a layer (so they carry a graph), a Linear, and a bias of 2 heads."""
    pixels = torch.randn(B, 4, 4, 2)
    return nn.Linear(2, 6)(pixels), nn.Linear(6, 6), nn.Parameter(torch.randn(2, 4, 4))


def _attention(rows: torch.Tensor, linear: nn.Linear, bias: nn.Parameter, extra=None) -> torch.Tensor:
    n, t, c = rows.shape
    q = linear(rows).view(n, t, 2, 3).transpose(1, 2)
    scores = (q @ q.transpose(-1, -2)) * 0.5 + bias.unsqueeze(0)
    if extra is not None:
        scores = scores + extra
    return (scores.softmax(-1) @ q).transpose(1, 2).reshape(n, t, c)


def _fused_attention(rows: torch.Tensor, bias: nn.Parameter, pick: str = "unbind") -> torch.Tensor:
    """timm's attention: one Linear for q, k and v, ``reshape(n, t, 3, H, D).permute(2, 0, 3, 1, 4)``, then the
    three picked along dim 0 (``unbind(0)``, or ``qkv[0], qkv[1], qkv[2]`` as older timm)."""
    n, t, c = rows.shape
    qkv = nn.Linear(c, 3 * c)(rows).reshape(n, t, 3, 2, c // 2).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0) if pick == "unbind" else (qkv[0], qkv[1], qkv[2])
    scores = (q * 0.5) @ k.transpose(-2, -1) + bias.unsqueeze(0)
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(n, t, c)


def _fused_kernel_attention(rows: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """q, k, v as in timm, attention by ``F.scaled_dot_product_attention`` (timm's ``fused_attn``)."""
    n, t, c = rows.shape
    q, k, v = linear(rows).reshape(n, t, 3, 2, c // 6).permute(2, 0, 3, 1, 4).unbind(0)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, t, c // 3)


def _heads_first(rows: torch.Tensor) -> torch.Tensor:
    """Heads stacked ahead of the rows: row ``h·n + r``, not example-major."""
    n, t, c = rows.shape
    return rows.view(n, t, 2, c // 2).permute(2, 0, 1, 3).reshape(2 * n, t, c // 2)


def _window_major(h: torch.Tensor) -> torch.Tensor:
    """The windows of every example stacked window by window: row ``w·B + b``."""
    rows = windows(h, 2)
    return rows.view(B, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


CASES = {
    "windows": (lambda h, lin, bias: windows(h, 2), True),
    "windows of a rolled map": (lambda h, lin, bias: windows(torch.roll(h, (1, 1), (1, 2)), 2), True),
    "after a Linear and a layer norm": (lambda h, lin, bias: nn.LayerNorm(6)(lin(windows(h, 2))), True),
    "attention output, with a bias parameter": (lambda h, lin, bias: _attention(windows(h, 2), lin, bias), True),
    "attention output, with a constant mask": (
        lambda h, lin, bias: _attention(windows(h, 2), lin, bias, torch.zeros(1, 1, 4, 4)), True),
    "attention output, q, k, v of one Linear unbound (timm)": (
        lambda h, lin, bias: _fused_attention(windows(h, 2), bias), True),
    "attention output, q, k, v of one Linear indexed (older timm)": (
        lambda h, lin, bias: _fused_attention(windows(h, 2), bias, pick="index"), True),
    "attention output of scaled_dot_product_attention (timm's fused_attn)": (
        lambda h, lin, bias: _fused_kernel_attention(windows(h, 2), lin), True),
    "windows stacked window by window": (lambda h, lin, bias: _window_major(h), False),
    "heads stacked ahead of the rows": (lambda h, lin, bias: _heads_first(windows(h, 2)), False),
    "a mean over the batch added to every row": (
        lambda h, lin, bias: windows(h, 2) + windows(h, 2).mean(0, keepdim=True), False),
    "attention output with the batch's mean scores added": (
        lambda h, lin, bias: _attention(windows(h, 2), lin, bias, (windows(h, 2) @ windows(h, 2).transpose(1, 2))
                                        .mean(0, keepdim=True).unsqueeze(1)), False),
    "rows of a parameter repeated": (lambda h, lin, bias: bias.reshape(2, 16, 1).repeat(6, 1, 1), False),
    "the examples themselves": (lambda h, lin, bias: h.reshape(B, 16, 6), False),
}


@pytest.mark.parametrize("name", CASES)
def test_which_rows_are_proven_example_major(name):
    make, expected = CASES[name]
    rows = make(*_maps())
    assert example_major_rows(rows.grad_fn, tuple(rows.shape), B) is expected


def test_windows_stacked_window_by_window_are_refused_when_there_are_as_many_windows_as_examples():
    """With ``nW = B`` the tensor ``(nW, B, T, C)`` before the stacking has ``B`` rows at dim 0: moved there by the
    transpose from dim 1, which holds the windows; before, it was taken for the examples."""
    maps = nn.Linear(2, 6)(torch.randn(4, 4, 4, 2))  # 4 examples, 4 windows of 2×2 each
    rows = windows(maps, 2)
    window_major = rows.view(4, 4, 4, 6).transpose(0, 1).reshape(16, 4, 6)
    assert example_major_rows(rows.grad_fn, tuple(rows.shape), 4)
    assert not example_major_rows(window_major.grad_fn, tuple(window_major.shape), 4)


@pytest.mark.parametrize("attention", [WindowAttention, FusedWindowAttention, KernelWindowAttention])
def test_a_swin_style_model_is_measured_whole(reference_sq_norms, attention):
    """Both the Linear and LayerNorm layers on the windows and the relative bias added to their scores (a bare
    parameter, read from its first pass on): every example's squared norm, against ``torch.func``; with separate
    q, k, v layers, and with timm's fused one, by hand or through ``scaled_dot_product_attention``'s kernel (before,
    its output layer's input was refused)."""
    model, x = SwinStyle(attention=attention), torch.rand(5, 64)
    weights = torch.randn(5, 10)
    with PerExampleNormTracker(model) as tracker:
        tracker.expected_batch_size = 5
        for _ in range(2):
            model.zero_grad()
            (model(x) * weights).sum().backward()
            got = tracker.pop()
        assert tracker.coverage_fraction() == 1.0
    torch.testing.assert_close(got.double(), reference_sq_norms(model, x, weights), rtol=1e-5, atol=0)


class WindowMajor(nn.Module):
    """:class:`SwinStyle`'s first block on windows stacked window by window (row ``w·B + b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.swin = SwinStyle()

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        h = self.swin.stem(pixels.view(-1, 1, 8, 8)).permute(0, 2, 3, 1)
        b = h.shape[0]
        rows = windows(h, 2).view(b, 16, 4, 8).transpose(0, 1).reshape(b * 16, 4, 8)
        rows = self.swin.blocks[0](rows).view(16, b, 4, 8).transpose(0, 1).reshape(b * 16, 4, 8)
        return self.swin.head((h + unwindowed(rows, 2, 8, 8)).mean((1, 2)))


def test_windows_stacked_in_another_order_are_refused_not_read_as_examples():
    model, x = WindowMajor(), torch.rand(5, 64)
    with PerExampleNormTracker(model) as tracker:
        tracker.expected_batch_size = 5
        model(x).sum().backward()
        with pytest.raises(RuntimeError, match="holds the batch of 5 examples"):
            tracker.pop()
