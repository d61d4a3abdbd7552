"""A non-leaf alias of a leaf tensor, so that a layer may write into its input in place.

Autograd refuses an in-place write (``nn.ReLU(inplace=True)``) into a leaf that requires
grad. Where the lab cuts a graph and makes the next layer's input a leaf of its own (a
pipeline stage's input, a layer timed alone by ``gpipe_lab.pipeline.measuring.costs``), the layer runs on
``writable(inputs)`` instead: the same memory, no copy, the gradient reaching the leaf.
Torch only: the engine and ``gpipe_lab.pipeline.measuring.costs`` both use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["writable"]


class _Alias(torch.autograd.Function):
    """The identity as a graph node: its output is no leaf, so a layer may write into it in place."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # noqa: D102
        return x.detach()  # shares memory and version counter with x; autograd sees no view

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # noqa: D102
        return grad


def writable(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """``inputs`` with each tensor leaf that requires grad replaced by its alias (the rest as they are).
    Call it with grad enabled: the alias is a graph node."""
    return tuple(_Alias.apply(t) if isinstance(t, Tensor) and t.requires_grad and t.is_leaf else t
                 for t in inputs)
