"""Capacity planner: per-partition parameter and peak activation memory, and the largest model that fits.

Per-layer facts (``LayerMemory``) are measured on the ``meta`` device and summed per chain of layers
by ``planner.memory``; this file sums them into partitions and searches the largest model that fits.

Memory model of partition k (mini-batch N, M micro-batches of N/M, bytes per
parameter b: RMSProp = 4 weight + 4 gradient + 4 slot = 12):
- parameters: P_k * b;
- without re-materialization (Naive-1: one device, whole batch at once):
  (I_k + S_k) * N, everything autograd saves for the whole mini-batch;
- with re-materialization (GPipe): I_k * N + (S_k + I_k + O_k) * N/M — the stored
  boundary inputs of all micro-batches, plus, during one micro-batch's recompute
  and backward, its internals and its boundary gradients (the paper's
  O(N + L/K * N/M)).
I_k, O_k, S_k: bytes per sample of the partition's input, output, and saved
internals (the input excluded). Not modelled: allocator fragmentation, kernel
workspaces, gradient buffers inside a layer, compiler fusion.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpipe_lab.pipeline import balance_by_cost
from gpipe_lab.planner.memory import LayerMemory, layer_records, partition_bytes

__all__ = ["PartitionMemory", "Plan", "GiB", "plan_memory", "best_plan", "largest", "max_transformer_layers",
           "max_amoebanet_filters", "RMSPROP_BYTES_PER_PARAM"]

GiB = 2**30
RMSPROP_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class PartitionMemory:
    """Bytes of one partition (``activation`` is the peak for the whole mini-batch)."""

    layers: int
    params: int
    parameter_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.parameter_bytes + self.activation_bytes


@dataclass(frozen=True)
class Plan:
    """A balance and each partition's memory; ``fits`` compares the largest with the capacity."""

    balance: list[int]
    partitions: list[PartitionMemory]
    capacity_bytes: float

    @property
    def params(self) -> int:
        return sum(p.params for p in self.partitions)

    @property
    def peak_bytes(self) -> float:
        return max(p.total_bytes for p in self.partitions)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes


def plan_memory(records: Sequence[LayerMemory], balance: Sequence[int], capacity_bytes: float,
                batch: int, microbatches: int = 1, remat: bool = True,
                bytes_per_param: float = RMSPROP_BYTES_PER_PARAM, activation_scale: float = 1.0) -> Plan:
    """Each partition's memory for ``balance`` (see the module docstring for the model).

    ``activation_scale`` rescales the measured (float32) activation bytes, e.g.
    0.5 for bfloat16 activations.

    Raises:
        ValueError: the balance does not cover the layers, or the batch is not divisible by M.
    """
    if sum(balance) != len(records) or min(balance) < 1:
        raise ValueError(f"balance {list(balance)} must be positive and sum to {len(records)} layers")
    if batch % microbatches:
        raise ValueError(f"batch {batch} is not divisible by {microbatches} micro-batches")
    parts, start, micro = [], 0, batch // microbatches
    for count in balance:
        chain = records[start:start + count]
        start += count
        i, o, s = partition_bytes(chain)
        act = i * batch + (s + i + o) * micro if remat else (i + s) * batch
        params = sum(r.params for r in chain)
        parts.append(PartitionMemory(count, params, params * bytes_per_param, act * activation_scale))
    return Plan(list(balance), parts, capacity_bytes)


def best_plan(records: Sequence[LayerMemory], partitions: int, capacity_bytes: float, batch: int,
              microbatches: int = 1, remat: bool = True,
              bytes_per_param: float = RMSPROP_BYTES_PER_PARAM, activation_scale: float = 1.0) -> Plan:
    """The balance (by memory, by parameters, or by activations) with the smallest peak.

    Raises:
        ValueError: more partitions than layers.
    """
    micro = batch // microbatches
    by_memory = [r.params * bytes_per_param + (sum(r.inputs) * (batch if remat else 0) + r.saved_other
                 * (micro if remat else batch)) for r in records]
    candidates = [by_memory, [float(r.params) for r in records], [float(r.saved_other) for r in records]]
    plans = [plan_memory(records, balance_by_cost(c, partitions), capacity_bytes, batch, microbatches,
                         remat, bytes_per_param, activation_scale) for c in candidates]
    return min(plans, key=lambda p: p.peak_bytes)


def largest(fits: Callable[[int], bool], high: int, low: int = 1) -> int:
    """Largest n in [low, high] with ``fits(n)`` (monotone), or low - 1 if none."""
    best = low - 1
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best


def max_transformer_layers(partitions: int, capacity_bytes: float, batch: int, microbatches: int,
                           remat: bool, name: str = "transformer_l", upper: int = 4096,
                           activation_scale: float = 1.0, **sizes: object) -> int:
    """Most layers of Transformer ``name`` whose best ``partitions``-way plan fits (0 if none)."""
    def fits(layers: int) -> bool:
        records = layer_records(name, num_layers=layers, **sizes)
        return len(records) >= partitions and best_plan(
            records, partitions, capacity_bytes, batch, microbatches, remat,
            activation_scale=activation_scale).fits
    return max(0, largest(fits, upper))


def max_amoebanet_filters(num_layers: int, partitions: int, capacity_bytes: float, batch: int,
                          microbatches: int, remat: bool, step: int = 8, upper: int = 2048,
                          activation_scale: float = 1.0, **sizes: object) -> int:
    """Largest D (a multiple of ``step``) such that AmoebaNet-D(num_layers, D) fits (0 if none)."""
    def fits(units: int) -> bool:
        records = layer_records("amoebanet_d", num_layers=num_layers, num_filters=units * step, **sizes)
        return best_plan(records, partitions, capacity_bytes, batch, microbatches, remat,
                         activation_scale=activation_scale).fits
    return max(0, largest(fits, upper // step)) * step
