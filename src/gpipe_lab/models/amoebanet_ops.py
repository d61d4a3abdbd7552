"""The operations an AmoebaNet cell applies to its hidden states.

Every operation keeps the channel count ``C`` of the cell; stride 2 is used only
on a reduction cell's two original inputs. Convolutions are bias-free and each
BatchNorm has 2 parameters per channel, as in tensorflow/tpu's
``models/official/amoeba_net/network_utils.py`` whose layout the parameter
formula of the paper (see ``amoebanet.py``) requires.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["FactorizedReduce", "build_operation", "relu_conv_bn", "OPERATION_NAMES"]


def relu_conv_bn(in_channels: int, out_channels: int, kernel_size: int = 1, stride: int = 1) -> nn.Sequential:
    """ReLU, bias-free ``kernel_size`` conv (same padding), BatchNorm."""
    return nn.Sequential(
        nn.ReLU(),
        nn.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class FactorizedReduce(nn.Module):
    """Halves the spatial size without dropping pixels: two strided 1x1 convs,
    one on the input and one on the input shifted by one pixel, concatenated.

    Used on a cell's older input when it is twice the spatial size of the newer one.
    Raises ``ValueError`` if ``out_channels`` is odd.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        if out_channels % 2:
            raise ValueError(f"FactorizedReduce needs an even out_channels, got {out_channels}")
        self.relu = nn.ReLU()
        self.path1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.path2 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        shifted = nn.functional.pad(x, (0, 1, 0, 1))[:, :, 1:, 1:]
        return self.bn(torch.cat([self.path1(x), self.path2(shifted)], dim=1))


def _bottleneck(channels: int, stride: int, middle: list[nn.Module]) -> nn.Sequential:
    """ReLU, 1x1 to C/4, BN, ReLU, ``middle`` convs, BN, ReLU, 1x1 back to C, BN."""
    return nn.Sequential(
        nn.ReLU(),
        nn.Conv2d(channels, channels // 4, 1, bias=False),
        nn.BatchNorm2d(channels // 4),
        nn.ReLU(),
        *middle,
        nn.BatchNorm2d(channels // 4),
        nn.ReLU(),
        nn.Conv2d(channels // 4, channels, 1, bias=False),
        nn.BatchNorm2d(channels),
    )


def _conv_3x3(c: int, stride: int) -> nn.Module:
    q = c // 4
    return _bottleneck(c, stride, [nn.Conv2d(q, q, 3, stride, 1, bias=False)])


def _conv_1x7_7x1(c: int, stride: int) -> nn.Module:
    # BN + ReLU between the 1x7 and the 7x1 conv (tensorflow/tpu's ``bn_1x7_7x1``):
    # the paper's parameter formula's (119/3)*L*D term counts exactly this BN.
    q = c // 4
    middle: list[nn.Module] = [
        nn.Conv2d(q, q, (1, 7), (1, stride), (0, 3), bias=False),
        nn.BatchNorm2d(q),
        nn.ReLU(),
        nn.Conv2d(q, q, (7, 1), (stride, 1), (3, 0), bias=False),
    ]
    return _bottleneck(c, stride, middle)


def _separable(c: int, stride: int, kernel: int, dilation: int = 1, repeats: int = 2) -> nn.Module:
    """``repeats`` x (ReLU, depthwise kxk conv, pointwise 1x1 conv, BN); stride on the first."""
    layers: list[nn.Module] = []
    for i in range(repeats):
        layers += [
            nn.ReLU(),
            nn.Conv2d(c, c, kernel, stride if i == 0 else 1, dilation * (kernel // 2), dilation,
                      groups=c, bias=False),
            nn.Conv2d(c, c, 1, bias=False),
            nn.BatchNorm2d(c),
        ]
    return nn.Sequential(*layers)


def _max_pool_2x2(stride: int) -> nn.Module:
    if stride == 2:
        return nn.MaxPool2d(2, 2, ceil_mode=True)
    # 'SAME' padding for a stride-1 2x2 window: pad right/bottom with -inf.
    return nn.Sequential(nn.ConstantPad2d((0, 1, 0, 1), float("-inf")), nn.MaxPool2d(2, 1))


def build_operation(name: str, channels: int, stride: int) -> nn.Module:
    """The module for operation ``name`` on ``channels`` channels with ``stride``.

    Raises ``ValueError`` for an unknown name.
    """
    c, s = channels, stride
    if name == "none":
        return nn.Identity() if s == 1 else relu_conv_bn(c, c, 1, s)
    if name == "1x1":
        return relu_conv_bn(c, c, 1, s)
    if name == "3x3":
        return _conv_3x3(c, s)
    if name == "1x7_7x1":
        return _conv_1x7_7x1(c, s)
    if name == "max_pool_3x3":
        return nn.MaxPool2d(3, s, 1)
    if name == "avg_pool_3x3":
        return nn.AvgPool2d(3, s, 1, count_include_pad=False)
    if name == "max_pool_2x2":
        return _max_pool_2x2(s)
    if name == "separable_3x3_2":
        return _separable(c, s, 3)
    if name == "dil_2_separable_5x5_2":
        return _separable(c, s, 5, dilation=2)
    raise ValueError(f"unknown AmoebaNet operation {name!r}; known: {', '.join(OPERATION_NAMES)}")


OPERATION_NAMES = (
    "none", "1x1", "3x3", "1x7_7x1", "max_pool_3x3", "avg_pool_3x3", "max_pool_2x2",
    "separable_3x3_2", "dil_2_separable_5x5_2",
)
