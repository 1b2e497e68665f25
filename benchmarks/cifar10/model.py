"""EfficientNet-B0 (Tan & Le 2019) for 32×32 inputs: ``timm``'s when it imports, else a plain-PyTorch one.

The fallback follows ``timm``'s ``efficientnet_b0`` layer for layer, so both have the same parameters
(4,020,358 for 10 classes; 5,288,548 for ImageNet's 1000):

* stem: 3×3 conv, 32 channels, BatchNorm, SiLU;
* seven stages of MBConv blocks (table below): an optional 1×1 expansion conv (× ``expansion``), a depthwise
  k×k conv (stride on the first block of a stage), squeeze-excitation (reduction to ¼ of the block's *input*
  channels, SiLU, sigmoid gate), a 1×1 projection conv with BatchNorm and no activation, and a residual
  connection with stochastic depth (drop-path rate growing linearly with the block index) where the shape
  allows; every conv is followed by BatchNorm (PyTorch defaults: eps 1e-5, momentum 0.1);
* head: 1×1 conv to 1280 channels, BatchNorm, SiLU, global average pool, dropout, linear classifier;
* initialisation as ``timm``'s (Google's): conv weights ``N(0, 2/fan_out)``, linear ``U(±1/√fan_out)``.

**32×32 inputs: the stem has stride 1** (instead of 2), so the overall stride is 16 instead of 32 and the last
feature map is 2×2 instead of 1×1; everything else is B0 unchanged. The same change is made to ``timm``'s model.

``width_mult``/``depth_mult`` scale channels (rounded to multiples of 8 as in ``timm``) and repeats (ceil) as
in the EfficientNet family; ``(1, 1)`` is B0. They exist for the quick CPU mode (``--tiny``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

#: B0's stages: (expansion, output channels, repeats, stride of the first block, depthwise kernel).
B0_STAGES: tuple[tuple[int, int, int, int, int], ...] = (
    (1, 16, 1, 1, 3),
    (6, 24, 2, 2, 3),
    (6, 40, 2, 2, 5),
    (6, 80, 3, 2, 3),
    (6, 112, 3, 1, 5),
    (6, 192, 4, 2, 5),
    (6, 320, 1, 1, 3),
)
STEM_CHANNELS = 32
HEAD_CHANNELS = 1280
SE_RATIO = 0.25
#: Parameter count of B0 with a 10-class head (``timm.create_model("efficientnet_b0", num_classes=10)`` too).
B0_PARAMS_10_CLASSES = 4_020_358


def make_divisible(v: float, divisor: int = 8, round_limit: float = 0.9) -> int:
    """``timm``'s channel rounding: nearest multiple of ``divisor``, never more than 10% below ``v``."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < round_limit * v:
        new_v += divisor
    return new_v


def round_channels(channels: int, width_mult: float) -> int:
    return channels if width_mult == 1.0 else make_divisible(channels * width_mult)


def round_repeats(repeats: int, depth_mult: float) -> int:
    return int(math.ceil(repeats * depth_mult))


class ConvBNAct(nn.Sequential):
    """Conv (no bias, "same" padding for odd kernels) → BatchNorm → SiLU (or no activation)."""

    def __init__(self, cin: int, cout: int, kernel: int = 1, stride: int = 1, groups: int = 1, act: bool = True):
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.SiLU(inplace=True) if act else nn.Identity(),
        )


class SqueezeExcite(nn.Module):
    """Global average pool → 1×1 conv (reduce, SiLU) → 1×1 conv (expand) → sigmoid gate on the channels."""

    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1, bias=True)
        self.act = nn.SiLU(inplace=True)
        self.expand = nn.Conv2d(reduced, channels, 1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(self.act(self.reduce(s))))


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Stochastic depth (Huang et al. 2016): drop the residual branch per example with probability ``p``."""
    if p <= 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


class MBConv(nn.Module):
    """Inverted residual block with depthwise conv and squeeze-excitation (expansion 1: no expansion conv)."""

    def __init__(self, cin: int, cout: int, expansion: int, stride: int, kernel: int, drop_path_rate: float = 0.0):
        super().__init__()
        mid = cin * expansion
        self.expand = ConvBNAct(cin, mid, 1) if expansion != 1 else nn.Identity()
        self.depthwise = ConvBNAct(mid, mid, kernel, stride=stride, groups=mid)
        self.se = SqueezeExcite(mid, max(1, int(cin * SE_RATIO)))
        self.project = ConvBNAct(mid, cout, 1, act=False)
        self.residual = stride == 1 and cin == cout
        self.drop_path_rate = drop_path_rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))
        if self.residual:
            out = x + drop_path(out, self.drop_path_rate, self.training)
        return out


class EfficientNet(nn.Module):
    """EfficientNet-B0 (``width_mult = depth_mult = 1``) with a configurable stem stride (1 for 32×32 inputs)."""

    def __init__(
        self,
        num_classes: int = 10,
        width_mult: float = 1.0,
        depth_mult: float = 1.0,
        dropout: float = 0.2,
        drop_path_rate: float = 0.2,
        stem_stride: int = 1,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        stem = round_channels(STEM_CHANNELS, width_mult)
        self.stem = ConvBNAct(in_channels, stem, 3, stride=stem_stride)
        plan = [
            (e, round_channels(c, width_mult), round_repeats(r, depth_mult), s, k) for e, c, r, s, k in B0_STAGES
        ]
        total = sum(r for _, _, r, _, _ in plan)
        blocks, cin, index = [], stem, 0
        for expansion, cout, repeats, stride, kernel in plan:
            stage = []
            for i in range(repeats):
                rate = drop_path_rate * index / total  # timm's linear schedule over blocks
                stage.append(MBConv(cin, cout, expansion, stride if i == 0 else 1, kernel, rate))
                cin, index = cout, index + 1
            blocks.append(nn.Sequential(*stage))
        self.blocks = nn.Sequential(*blocks)
        self.num_features = round_channels(HEAD_CHANNELS, width_mult)
        self.head = ConvBNAct(cin, self.num_features, 1)
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(self.num_features, num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                bound = 1.0 / math.sqrt(m.out_features)
                nn.init.uniform_(m.weight, -bound, bound)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(self.dropout(torch.flatten(x.mean((2, 3)), 1)))


def timm_available() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:  # ImportError, or a broken torchvision/timm install against this torch
        return False
    return True


def build_model(
    num_classes: int = 10,
    *,
    width_mult: float = 1.0,
    depth_mult: float = 1.0,
    dropout: float = 0.2,
    drop_path_rate: float = 0.2,
    impl: str = "auto",
) -> tuple[nn.Module, str]:
    """``(model, description)``. ``impl``: ``"timm"``, ``"builtin"``, or ``"auto"`` (``timm`` for B0 when it
    imports; the fallback otherwise, and always for scaled widths/depths, which ``timm`` does not expose for B0)."""
    if impl not in ("auto", "timm", "builtin"):
        raise ValueError(f"impl={impl!r}: 'auto', 'timm' or 'builtin'")
    scaled = (width_mult, depth_mult) != (1.0, 1.0)
    use_timm = impl == "timm" or (impl == "auto" and not scaled and timm_available())
    if use_timm:
        if scaled:
            raise ValueError("impl='timm' builds B0 only; use impl='builtin' with width/depth multipliers")
        import timm

        model = timm.create_model(
            "efficientnet_b0", pretrained=False, num_classes=num_classes, drop_rate=dropout,
            drop_path_rate=drop_path_rate,
        )
        model.conv_stem.stride = (1, 1)  # 32×32 inputs: stride-1 stem, as in the fallback
        return model, f"timm {timm.__version__} efficientnet_b0 (stem stride 1 for 32×32)"
    model = EfficientNet(num_classes, width_mult, depth_mult, dropout, drop_path_rate, stem_stride=1)
    name = "EfficientNet-B0" if not scaled else f"EfficientNet (width ×{width_mult:g}, depth ×{depth_mult:g})"
    return model, f"{name}, built-in PyTorch fallback (stem stride 1 for 32×32)"


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def output_stride_map(model: nn.Module, size: int = 32) -> Optional[int]:
    """Spatial size of the last feature map for a ``size``×``size`` input (fallback model only)."""
    if not isinstance(model, EfficientNet):
        return None
    with torch.no_grad():
        was = model.training
        model.eval()
        out = model.head(model.blocks(model.stem(torch.zeros(1, 3, size, size))))
        model.train(was)
    return int(out.shape[-1])
