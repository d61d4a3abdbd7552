"""Cutting a layer sequence into K partitions.

The paper gives each layer a cost c_i and balances the cells' costs. We pick
contiguous partitions that minimize the most expensive one (the stage that
sets the pipeline's pace): a binary search on that maximum with a greedy
feasibility check, which is exact for non-negative costs.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn


def parameter_costs(module: nn.Sequential) -> list[float]:
    """Cost of each layer = its number of parameter elements (the default c_i)."""
    return [float(sum(p.numel() for p in layer.parameters())) for layer in module]


def layer_costs(module: nn.Sequential, cost: object = None) -> list[float]:
    """Resolve a cost specification to one number per layer.

    ``cost`` is ``None`` or ``"params"`` (parameter count), a sequence of numbers,
    or a callable ``layer -> number``.

    Raises:
        ValueError: wrong length, negative or non-finite costs, or an unknown name.
    """
    if cost is None or cost == "params":
        costs = parameter_costs(module)
    elif isinstance(cost, str):
        raise ValueError(
            f"unknown cost {cost!r}; allowed: 'params', a list of per-layer numbers, or a callable "
            "(for measured time use gpipe_lab.pipeline.balance_by_time)"
        )
    elif callable(cost):
        costs = [float(cost(layer)) for layer in module]
    else:
        costs = [float(c) for c in cost]  # type: ignore[union-attr]
    if len(costs) != len(module):
        raise ValueError(f"got {len(costs)} layer costs for a module of {len(module)} layers")
    for i, c in enumerate(costs):
        if not c >= 0 or c == float("inf"):
            raise ValueError(f"layer {i} has cost {c}; costs must be finite and non-negative")
    if sum(costs) == 0:
        costs = [1.0] * len(costs)
    return costs


def _greedy_parts(costs: Sequence[float], partitions: int, limit: float) -> list[int] | None:
    """Exactly ``partitions`` contiguous parts each ≤ limit, or None if impossible."""
    n = len(costs)
    balance: list[int] = []
    i = 0
    for p in range(partitions):
        remaining_parts = partitions - p - 1
        total, count = 0.0, 0
        while i < n and n - i > remaining_parts:
            if count > 0 and total + costs[i] > limit:
                break
            total += costs[i]
            count += 1
            i += 1
        if count == 0 or total > limit:
            return None
        balance.append(count)
    return balance if i == n else None


def balance_by_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """Layers per partition minimizing the largest partition cost.

    Raises:
        ValueError: fewer layers than partitions, or partitions < 1.
    """
    n = len(costs)
    if partitions < 1:
        raise ValueError(f"partitions must be >= 1, got {partitions}")
    if partitions > n:
        raise ValueError(f"cannot cut {n} layers into {partitions} partitions (more partitions than layers)")
    low, high = max(costs), float(sum(costs))
    best = _greedy_parts(costs, partitions, high)
    for _ in range(100):
        if high - low <= 1e-9 * max(1.0, high):
            break
        mid = (low + high) / 2
        found = _greedy_parts(costs, partitions, mid)
        if found is None:
            low = mid
        else:
            best, high = found, mid
    assert best is not None  # the total cost is always feasible when n >= partitions
    return best


def balance_by_time(
    module: nn.Sequential, sample: torch.Tensor | tuple[torch.Tensor, ...], partitions: int,
    repeat: int = 3,
) -> list[int]:
    """Balance by the measured forward+backward time of each layer on ``sample``."""
    times = [0.0] * len(module)
    for _ in range(repeat):
        value: object = sample
        for i, layer in enumerate(module):
            start = time.perf_counter()
            value = layer(value)
            outputs = value if isinstance(value, tuple) else (value,)
            loss = sum(t.float().sum() for t in outputs if t.requires_grad)
            if isinstance(loss, torch.Tensor):
                loss.backward(retain_graph=True)
            times[i] += time.perf_counter() - start
            value = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in outputs)
            value = value[0] if len(value) == 1 else value
    module.zero_grad(set_to_none=True)
    return balance_by_cost(times, partitions)


def check_balance(balance: Sequence[int], num_layers: int) -> list[int]:
    """Validate a user balance.

    Raises:
        ValueError: non-positive entries, or a sum that differs from the layer count.
    """
    balance = list(balance)
    if not balance:
        raise ValueError("balance is empty; give one layer count per partition, e.g. [3, 5]")
    for i, b in enumerate(balance):
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"balance[{i}] = {b!r}; every partition needs a positive number of layers")
    if sum(balance) != num_layers:
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} but the module has {num_layers} layers; "
            f"use partitions=K for an automatic balance"
        )
    return balance


def split_module(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """The partitions as ``nn.Sequential`` views sharing the original layers.

    Raises:
        ValueError: a parameter is shared between two partitions.
    """
    layers = list(module)  # not children(): that drops a layer listed twice
    parts, start = [], 0
    for count in balance:
        parts.append(nn.Sequential(*layers[start:start + count]))
        start += count
    owner: dict[int, int] = {}
    for k, part in enumerate(parts):
        for name, p in part.named_parameters():
            if id(p) in owner and owner[id(p)] != k:
                raise ValueError(
                    f"parameter {name!r} of partition {k} is also used by partition {owner[id(p)]}; "
                    "shared parameters cannot cross partitions (e.g. tied embeddings): untie them "
                    "or choose a balance that keeps them together"
                )
            owner[id(p)] = k
    return parts
