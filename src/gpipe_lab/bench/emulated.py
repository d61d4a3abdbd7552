"""Emulated devices: layers whose forward and backward take a set time without using the CPU.

Two cores cannot run eight compute-bound stages, but the engine's own mechanics
(schedule execution, hand-overs, bookkeeping, the bubble) can be measured at any
K when each stage's work takes device-like time without holding a core. An
``EmulatedLayer`` sleeps ``fixed + per_sample x n`` seconds in its forward (also
under ``no_grad`` and when a checkpoint replays it) and ``backward_ratio`` times
that in its backward, then computes ``x * w`` with one scalar weight, so
gradients flow and every stage has a parameter. Sleeping releases the GIL:
eight stages sleeping at once cost no CPU, as eight devices computing would.
With ``weight_share`` s > 0 the backward's share s sleeps on the weight's side of the
product, so a split backward (``B``, then ``W``: the zero-bubble schedules) spends
1-s of it in ``B`` and s in ``W``, as a real layer's input and weight gradients would.

``EmulatedSpec`` mirrors a ``WorkloadSpec``: the per-layer costs are the model's
per-layer FLOPs (the cost model the engine balances by) scaled so that one
forward over the mini-batch takes ``forward_ms``; its balance is the FLOPs
balance the real model gets. The module is a plain ``nn.Sequential``, so it runs
on either transport (``GPipe`` threads or ``DistributedGPipe`` ranks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gpipe_lab.pipeline import balance_by_cost
from gpipe_lab.pipeline.options import forwarded
from gpipe_lab.planner.workload import Workload, WorkloadSpec, mse


class _Sleep(torch.autograd.Function):
    """``x * w`` whose forward sleeps ``forward_s`` and whose backward sleeps ``backward_s``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, forward_s: float, backward_s: float) -> Tensor:
        time.sleep(forward_s)
        ctx.save_for_backward(x, weight)
        ctx.backward_s = backward_s
        return x * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, weight = ctx.saved_tensors
        time.sleep(ctx.backward_s)
        return grad * weight, (grad * x).sum().reshape(weight.shape), None, None


class _SleepBackward(torch.autograd.Function):
    """The identity, whose forward sleeps ``forward_s`` and whose backward sleeps ``backward_s``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class EmulatedLayer(nn.Module):
    """A layer that takes ``fixed_s + per_sample_s * n`` seconds forward on ``n`` samples, and
    ``backward_ratio`` times that backward, sleeping instead of computing; ``weight_share`` of
    the backward is the weight gradient's (see the module docstring).

    Raises:
        ValueError: a negative time or ratio, or ``weight_share`` outside [0, 1].
    """

    def __init__(self, per_sample_s: float, fixed_s: float = 0.0, backward_ratio: float = 2.0,
                 weight_share: float = 0.0) -> None:
        super().__init__()
        if per_sample_s < 0 or fixed_s < 0 or backward_ratio < 0:
            raise ValueError(f"emulated times must be >= 0, got per_sample_s={per_sample_s}, fixed_s={fixed_s}, "
                             f"backward_ratio={backward_ratio}")
        if not 0.0 <= weight_share <= 1.0:
            raise ValueError(f"weight_share must be in [0, 1], got {weight_share}")
        self.per_sample_s, self.fixed_s, self.backward_ratio = per_sample_s, fixed_s, backward_ratio
        self.weight_share = weight_share
        self.weight = nn.Parameter(torch.ones(1))

    def forward_seconds(self, samples: int) -> float:
        """Seconds the forward sleeps on ``samples`` samples."""
        return self.fixed_s + self.per_sample_s * samples

    def forward(self, x: Tensor) -> Tensor:
        seconds = self.forward_seconds(int(x.shape[0]))
        if not self.weight_share:
            return _Sleep.apply(x, self.weight, seconds, seconds * self.backward_ratio)
        # two sleeping identities joined by a plain product: the product is the node a split
        # backward cuts at, so B sleeps on the input's side and W on the weight's
        backward = seconds * self.backward_ratio
        inputs = _SleepBackward.apply(x, seconds, backward * (1.0 - self.weight_share))
        return inputs * _SleepBackward.apply(self.weight, 0.0, backward * self.weight_share)

    def extra_repr(self) -> str:
        return f"per_sample_s={self.per_sample_s:.3g}, fixed_s={self.fixed_s:.3g}, backward={self.backward_ratio:g}x"


def emulated_module(per_sample_s: Sequence[float], fixed_s: float = 0.0, backward_ratio: float = 2.0,
                    weight_share: float = 0.0) -> nn.Sequential:
    """One ``EmulatedLayer`` per entry of ``per_sample_s`` (seconds per sample of each layer's forward).

    Raises:
        ValueError: no layer, a negative time, or ``weight_share`` outside [0, 1].
    """
    if not per_sample_s:
        raise ValueError("an emulated model needs at least one layer time")
    return nn.Sequential(*[EmulatedLayer(s, fixed_s, backward_ratio, weight_share) for s in per_sample_s])


def emulated_workload(name: str, per_sample_s: Sequence[float], batch: int, balance: Sequence[int],
                      backward_ratio: float = 2.0, seed: int = 0) -> Workload:
    """An emulated module on a ``[batch, 1]`` regression batch (MSE) with the given balance.

    Raises:
        ValueError: a batch below 1, a negative time, or a balance that does not cover the layers.
    """
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if sum(balance) != len(per_sample_s) or any(b < 1 for b in balance):
        raise ValueError(f"balance {list(balance)} must be positive and sum to the {len(per_sample_s)} layers")
    torch.manual_seed(seed)
    module = emulated_module(per_sample_s, backward_ratio=backward_ratio)
    return Workload(name, module, torch.randn(batch, 1), torch.randn(batch, 1), mse, list(balance),
                    {"batch": batch, "emulated": True, "forward_s": sum(per_sample_s) * batch})


def balanced(layers: int, partitions: int) -> list[int]:
    """``layers`` split into ``partitions`` stages of equal size (as equal as integers allow).

    Raises:
        ValueError: ``partitions`` outside 1..``layers``.
    """
    if not 1 <= partitions <= layers:
        raise ValueError(f"partitions must be in 1..{layers}, got {partitions}")
    return [layers // partitions + (k < layers % partitions) for k in range(partitions)]


@dataclass(frozen=True)
class EmulatedSpec:
    """Emulated devices for ``spec``'s network: per-layer FLOPs scaled so the mini-batch forward takes
    ``forward_ms``; with ``uniform`` every layer costs the same (balanced stages when K divides the
    layer count). Built like a ``WorkloadSpec`` (``build(K)``, ``balance``, ``name``, ``batch``)."""

    spec: WorkloadSpec
    forward_ms: float
    backward_ratio: float = 2.0
    uniform: bool = False

    name = forwarded("spec.name", "The emulated network's name.")
    batch = forwarded("spec.batch", "The mini-batch size.")

    def per_sample_seconds(self) -> list[float]:
        """Each layer's forward seconds per sample.

        Raises:
            ValueError: ``forward_ms`` not positive.
        """
        if self.forward_ms <= 0:
            raise ValueError(f"forward_ms must be > 0, got {self.forward_ms}")
        flops = [1.0] * len(self.spec.model()) if self.uniform else self.spec.flops()
        total = sum(flops) or 1.0
        return [self.forward_ms / 1e3 * f / total / self.batch for f in flops]

    def model(self, seed: int = 0) -> nn.Sequential:
        """The emulated network (weights all one)."""
        return emulated_module(self.per_sample_seconds(), backward_ratio=self.backward_ratio)

    def balance(self, model: nn.Sequential | Sequence[Any], partitions: int) -> list[int]:
        """The real network's FLOPs balance (or equal stages with ``uniform``).

        Raises:
            ValueError: more partitions than layers.
        """
        if self.uniform:
            return balanced(len(model), partitions)
        if partitions == 1:
            return [len(model)]
        return balance_by_cost(self.spec.flops(), partitions)

    def build(self, partitions: int = 1, seed: int = 0) -> Workload:
        """The emulated workload split into ``partitions`` stages.

        Raises:
            ValueError: more partitions than layers, or ``forward_ms`` not positive.
        """
        times = self.per_sample_seconds()
        return emulated_workload(self.name, times, self.batch, self.balance(range(len(times)), partitions),
                                 self.backward_ratio, seed)
