"""AmoebaNet-D(L, D) and AmoebaNet-B(N, F) as a flat ``nn.Sequential`` of cells.

Layout (paper.md): stem (ReLU, 3x3 stride-2 conv to D/4, BN), two reduction stem
cells at D/2 and D, then L/3 normal cells at D, a reduction cell at 2D, L/3 normal
cells at 2D, a reduction cell at 4D, L/3 normal cells at 4D, ReLU, global average
pool, linear classifier.

Cell wiring (tensorflow/tpu ``network_utils.BaseCell``): the newer input always
goes through ReLU-1x1 conv-BN to C channels; the older input goes through a
``FactorizedReduce`` when its spatial size is twice the newer one's (the cell
before was a reduction), else through ReLU-1x1 conv-BN when its channel count
is not C, else unchanged. With 1000 classes the D genotype has exactly

    P(L, D) = 96.25 L D^2 + (119/3) L D + 70.546875 D^2 + 16101 D + 1000

parameters: 81,505,540 for (18, 208), 319,024,120 for (18, 416) ... (see the
tests, which count them on the meta device).

The B genotype (separable convolutions; reduction cells output 2C) on the same
skeleton has 560,053,608 parameters for (18, 512), 0.5% above the paper's 557M.
With tensorflow/tpu's stem-cell widths (D/4, D/2 instead of D/2, D; option
``stem_cell_filters``) it has 557,333,736, which matches "557M". The D formula,
in contrast, needs the (D/2, D) stem cells, so that stays the default for both.
Both numbers are computed in ``tests/test_models_amoebanet.py``.

Layer boundary format: the first layer takes images ``[B, 3, H, W]`` and returns
``(x, x)``; every cell takes ``(prev, cur)`` and returns ``(cur, new)``; the
classifier takes ``(prev, cur)`` and returns logits ``[B, num_classes]``.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import Tensor, nn

from gpipe_lab.models.amoebanet_genotypes import GENOTYPES, CellSpec
from gpipe_lab.models.amoebanet_ops import FactorizedReduce, build_operation, relu_conv_bn

__all__ = ["Stem", "Cell", "Classifier", "build_amoebanet", "amoebanet_d_params"]


def amoebanet_d_params(num_layers: int, num_filters: int, num_classes: int = 1000) -> float:
    """The paper's closed form P(L, D) (extended to any class count); exact for L/3 >= 2.

    With a single normal cell per stack (L = 3) the real count differs: each
    reduction cell's older input is then the previous reduction cell's 3C-channel
    output instead of a normal cell's 4C-channel output.
    """
    L, D = num_layers, num_filters
    return 96.25 * L * D * D + (119 / 3) * L * D + 70.546875 * D * D + 101 * D + (16 * D + 1) * num_classes


class Stem(nn.Module):
    """ReLU, 3x3 stride-2 conv, BN; returns ``(x, x)`` so the first cell sees two states."""

    def __init__(self, out_channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(3, out_channels, 3, 2, 1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, images: Tensor) -> tuple[Tensor, Tensor]:
        x = self.bn(self.conv(self.relu(images)))
        return x, x


class Cell(nn.Module):
    """One normal or reduction cell: ``(prev, cur) -> (cur, new)``."""

    def __init__(self, spec: CellSpec, prev_channels: int, cur_channels: int, channels: int,
                 reduction: bool, prev_is_larger: bool) -> None:
        super().__init__()
        self.spec = spec
        self.preprocess_cur = relu_conv_bn(cur_channels, channels)
        self.preprocess_prev: nn.Module
        if prev_is_larger:
            self.preprocess_prev = FactorizedReduce(prev_channels, channels)
        elif prev_channels != channels:
            self.preprocess_prev = relu_conv_bn(prev_channels, channels)
        else:
            self.preprocess_prev = nn.Identity()
        self.ops = nn.ModuleList(
            build_operation(op, channels, 2 if reduction and index < 2 else 1)
            for op, index in zip(spec.ops, spec.indices)
        )
        self.out_channels = channels * len(spec.concat)

    def forward(self, states: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        prev, cur = states
        hidden = [self.preprocess_cur(cur), self.preprocess_prev(prev)]
        idx = self.spec.indices
        for i in range(0, len(self.ops), 2):
            hidden.append(self.ops[i](hidden[idx[i]]) + self.ops[i + 1](hidden[idx[i + 1]]))
        return cur, torch.cat([hidden[i] for i in self.spec.concat], dim=1)

    def extra_repr(self) -> str:
        return f"ops={self.spec.ops}, indices={self.spec.indices}, concat={self.spec.concat}"


class Classifier(nn.Module):
    """ReLU, global average pool, linear: ``(prev, cur) -> logits [B, num_classes]``."""

    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, states: tuple[Tensor, Tensor]) -> Tensor:
        _, cur = states
        return self.fc(torch.flatten(self.pool(self.relu(cur)), 1))


def build_amoebanet(genotype: str = "d", num_layers: int = 18, num_filters: int = 208,
                    num_classes: int = 1000, stem_cell_filters: tuple[int, int] | None = None,
                    ) -> nn.Sequential:
    """AmoebaNet-``genotype``(num_layers, num_filters) as a flat ``nn.Sequential``.

    Raises ``ValueError`` if the genotype is unknown, a size is not positive,
    ``num_layers`` is not divisible by 3, or ``num_filters`` is not divisible by 8
    (the stem cells work at D/2 channels with D/8-channel bottlenecks).
    ``stem_cell_filters`` overrides the two stem cells' widths (default D/2, D).
    """
    if genotype not in GENOTYPES:
        raise ValueError(f"unknown AmoebaNet genotype {genotype!r}; known: {sorted(GENOTYPES)}")
    for key, value in (("num_layers", num_layers), ("num_filters", num_filters), ("num_classes", num_classes)):
        if value <= 0:
            raise ValueError(f"{key} must be positive, got {value}")
    if num_layers % 3:
        raise ValueError(f"num_layers must be divisible by 3, got {num_layers}")
    if num_filters % 8:
        raise ValueError(f"num_filters must be divisible by 8, got {num_filters}")
    geno = GENOTYPES[genotype]
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    channels = num_filters // 4
    layers["stem"] = Stem(channels)
    prev_ch = cur_ch = channels
    prev_is_larger = False  # is the older state twice the newer state's spatial size?

    def add(name: str, reduction: bool, channels: int) -> None:
        nonlocal prev_ch, cur_ch, prev_is_larger
        spec = geno.reduction if reduction else geno.normal
        cell = Cell(spec, prev_ch, cur_ch, channels, reduction, prev_is_larger)
        layers[name] = cell
        prev_ch, cur_ch, prev_is_larger = cur_ch, cell.out_channels, reduction

    stem1, stem2 = stem_cell_filters or (num_filters // 2, num_filters)
    add("stem_reduction1", True, stem1)
    add("stem_reduction2", True, stem2)
    per_stack = num_layers // 3
    for stack, scale in enumerate((1, 2, 4)):
        if stack:
            add(f"reduction{stack}", True, num_filters * scale)
        for i in range(per_stack):
            add(f"normal{stack + 1}_{i + 1}", False, num_filters * scale)
    layers["classifier"] = Classifier(cur_ch, num_classes)
    return nn.Sequential(layers)
