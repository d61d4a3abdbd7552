"""Cutting a layer sequence into K partitions.

The paper gives each layer a cost c_i and balances the cells' costs. We pick
contiguous partitions that minimize the most expensive one (the stage that
sets the pipeline's pace): a binary search on that maximum with a greedy
feasibility check, which is exact for non-negative costs. Per-layer costs come
from ``gpipe_lab.pipeline.measuring.costs.layer_costs``; measured balances live in ``profiling``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from gpipe_lab.pipeline.measuring.costs import layer_costs, parameter_costs
from gpipe_lab.pipeline.options import PipelineOptions

__all__ = ["balance_by_cost", "check_balance", "check_layer_count", "layer_costs", "parameter_costs", "resolve_balance",
           "split_module"]


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


def check_layer_count(options: PipelineOptions, num_layers: int, prefix: str = "",
                      subject: str = "the module", default_partitions: int | None = None) -> None:
    """The one rule for K, v and the balance against a layer count, for every front door.

    ``prefix`` and ``subject`` word the message as the caller's user wrote the options
    (``pipeline.`` and ``model 'x'`` for the app).

    Raises:
        ValueError: a balance that does not sum to ``num_layers``, or more chunks (K·v) than
            layers; the message starts with the option's key.
    """
    if options.balance is not None:
        if sum(options.balance) != num_layers:
            raise ValueError(f"{prefix}balance: {list(options.balance)} sums to {sum(options.balance)} but "
                             f"{subject} has {num_layers} layers; use {prefix}partitions=K for an automatic balance")
        return
    k = options.partitions if options.partitions is not None else default_partitions
    if k is None:
        return
    if k > num_layers:
        raise ValueError(f"{prefix}partitions: {k} partitions but {subject} has only {num_layers} layers")
    v = options.virtual_stages
    if k * v > num_layers:
        raise ValueError(f"{prefix}virtual_stages: {k} partitions x {v} virtual stages = {k * v} chunks but "
                         f"{subject} has only {num_layers} layers; lower {prefix}virtual_stages or "
                         f"{prefix}partitions")


def resolve_balance(module: nn.Sequential, options: PipelineOptions,
                    default_partitions: int | None = None, sample: Any = None) -> list[int]:
    """Layers per chunk (K·v entries): ``options.balance`` checked against the module, or
    ``options.partitions`` (else ``default_partitions``) × ``virtual_stages`` chunks balanced
    by ``options.cost`` (a measured cost on ``sample``, one micro-batch of inputs). Both front
    doors cut the module here.

    Raises:
        ValueError: no balance nor partitions, more chunks than layers, a balance that does
            not cover the layers or whose length is not a multiple of ``virtual_stages``.
    """
    v = options.virtual_stages
    if options.balance is not None:
        check_layer_count(options, len(module))
        balance = check_balance(options.balance, len(module))
        if len(balance) % v:
            raise ValueError(f"balance {balance} has {len(balance)} entries, not a multiple of "
                             f"virtual_stages={v} (give one entry per chunk: K·v)")
        return balance
    partitions = options.partitions if options.partitions is not None else default_partitions
    if partitions is None:
        raise ValueError("give either balance=[layers per partition] or partitions=K")
    check_layer_count(options, len(module), default_partitions=default_partitions)
    return balance_by_cost(layer_costs(module, options.cost, sample), partitions * v)


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
