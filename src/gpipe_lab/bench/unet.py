"""A small U-Net-style model, written twice: with long skips and the old way.

``unet(levels, width)`` is a flat ``nn.Sequential`` ``stem, down × levels, middle, up × levels,
head`` whose encoder blocks ``stash`` their features and whose decoder blocks ``pop`` them
(``gpipe_lab.pipeline.skip``): cut into stages, each feature goes straight from the encoder's
stage to the decoder's. ``carried(model)`` is the same layers written without skips: every
boundary value is a tuple ``(x, feature_1, ..., feature_n)`` and each feature rides through every
stage between its encoder and its decoder. The two share their parameters (and their order), so
their losses and gradients are equal; the tests and the bytes probe
(``benchmarks/probes/skip_bytes.py``) compare them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline.skip import isolate, pop, skippable, stash


def _block(width_in: int, width: int, dropout: float, batch_norm: bool) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(width_in, width)]
    if batch_norm:
        layers.append(nn.BatchNorm1d(width))
    layers.append(nn.GELU())
    if dropout:
        layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


@skippable(stash=["feature"])
class Down(nn.Module):
    """An encoder block: its output is also stashed for the decoder block of its level."""

    def __init__(self, width: int, dropout: float = 0.0, batch_norm: bool = False) -> None:
        super().__init__()
        self.body = _block(width, width, dropout, batch_norm)

    def forward(self, x: Tensor) -> Tensor:
        y = self.body(x)
        stash("feature", y)
        return y


@skippable(pop=["feature"])
class Up(nn.Module):
    """A decoder block: joins its input with the feature of its level's encoder block."""

    def __init__(self, width: int, dropout: float = 0.0, batch_norm: bool = False) -> None:
        super().__init__()
        self.body = _block(2 * width, width, dropout, batch_norm)

    def forward(self, x: Tensor) -> Tensor:
        return self.body(torch.cat([x, pop("feature")], dim=1))


def unet(levels: int = 3, width: int = 16, features: int = 8, dropout: float = 0.0,
         batch_norm: bool = False, seed: int = 0) -> nn.Sequential:
    """``2·levels + 3`` layers: stem, encoder blocks, middle, decoder blocks, head (seeded weights)."""
    torch.manual_seed(seed)
    downs = [isolate(Down(width, dropout, batch_norm), f"level{i}") for i in range(levels)]
    ups = [isolate(Up(width, dropout, batch_norm), f"level{i}") for i in reversed(range(levels))]
    return nn.Sequential(nn.Linear(features, width), *downs, _block(width, width, dropout, batch_norm),
                         *ups, nn.Linear(width, features))


def _as_tuple(value: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return (value,) if isinstance(value, Tensor) else tuple(value)


def _result(values: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
    return values[0] if len(values) == 1 else values


class CarryDown(nn.Module):
    """``Down`` without skips (its body, not the skippable block): appends its feature to the tuple."""

    def __init__(self, block: Down) -> None:
        super().__init__()
        self.body = block.body

    def forward(self, value: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        x, *carried = _as_tuple(value)
        y = self.body(x)
        return (y, *carried, y)


class CarryUp(nn.Module):
    """``Up`` without skips: takes its feature from the end of the tuple."""

    def __init__(self, block: Up) -> None:
        super().__init__()
        self.body = block.body

    def forward(self, value: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        x, *carried, feature = value
        return _result((self.body(torch.cat([x, feature], dim=1)), *carried))


class Carry(nn.Module):
    """Any other layer: applied to the first value, the carried features passed on untouched."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, value: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        x, *carried = _as_tuple(value)
        return _result((self.layer(x), *carried))


def carried(model: nn.Sequential) -> nn.Sequential:
    """``model``'s layers (shared, not copied) written the old way: features ride in the tuple."""
    wrapped: list[nn.Module] = []
    for layer in model:
        if isinstance(layer, Down):
            wrapped.append(CarryDown(layer))
        elif isinstance(layer, Up):
            wrapped.append(CarryUp(layer))
        else:
            wrapped.append(Carry(layer))
    return nn.Sequential(*wrapped)
