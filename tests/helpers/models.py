"""Shared test helpers: small models whose pipelined runs are compared to plain ones."""

from __future__ import annotations

import torch
from torch import nn


class Pair(nn.Module):
    """A layer that reads and returns a tuple (a, b): exercises tuple boundaries."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, pair):
        a, b = pair
        return torch.tanh(self.mix(a)) + b, torch.sigmoid(self.gate(b)) * a


class Split(nn.Module):
    def forward(self, x):
        return x, x * 0.5


class Merge(nn.Module):
    def forward(self, pair):
        return pair[0] - pair[1]


def mlp(depth: int = 6, width: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                           for _ in range(depth)])


def tuple_model(width: int = 8, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), Split(), Pair(width), Pair(width), Merge(),
                         nn.Linear(width, width))


def grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in module.parameters()]


def reference_step(model: nn.Module, x, y, loss_fn):
    loss = loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), grads(model)
