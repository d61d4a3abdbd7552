"""Capacity planner: per-partition parameter and peak activation memory, and the largest model that fits.

Per-layer facts are measured on the ``meta`` device (nothing is allocated): a
``saved_tensors_hooks`` pack hook sees every tensor autograd keeps for backward;
they are counted by the lab's one rule (``gpipe_lab.saved_bytes``: parameters
and buffers excluded, each distinct view once) and split by storage into the
layer's saved inputs, saved outputs and other internals, per sample (one-sample batches). Records are cached by (layer
structure, input shapes); a Transformer measures one layer, AmoebaNet one cell
per distinct shape (``layer_records``).

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

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.models import build, example_input, preset_options
from gpipe_lab.pipeline.partition import balance_by_cost
from gpipe_lab.saved_bytes import SavedBytes, storage_key, storage_keys

__all__ = ["LayerMemory", "PartitionMemory", "Plan", "GiB", "layer_records", "partition_bytes", "plan_memory",
           "best_plan", "max_transformer_layers", "max_amoebanet_filters", "RMSPROP_BYTES_PER_PARAM"]

GiB = 2**30
RMSPROP_BYTES_PER_PARAM = 12


@dataclass(frozen=True)
class LayerMemory:
    """One layer: parameters and per-sample bytes of its boundary and saved tensors."""

    params: int
    inputs: tuple[int, ...]        # bytes per sample of each input tensor
    outputs: tuple[int, ...]       # bytes per sample of each output tensor
    passthrough: tuple[int, ...]   # per output: input index it is, -2-j if it is output j, -1 if new
    saved_inputs: frozenset[int]   # input positions autograd saves
    saved_outputs: frozenset[int]  # output positions autograd saves
    saved_other: int               # other saved bytes per sample (deduplicated, parameters excluded)


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


def _tensors(value: object) -> list[Tensor]:
    return [t for t in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(t, Tensor)]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _batchnorm_stand_in(self: nn.modules.batchnorm._BatchNorm, x: Tensor) -> Tensor:
    """Saves what training-mode BatchNorm saves per sample (its input), without the slow meta kernel."""
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return x * self.weight.view(shape) + self.bias.view(shape) if self.affine else x * 1.0


def _measure(layer: nn.Module, inputs: object, loss: bool) -> tuple[LayerMemory, object]:
    """Run ``layer`` once on meta one-sample ``inputs``; returns its record and output.

    BatchNorm runs as a stand-in that saves its input as the real one does (its
    per-channel statistics, independent of the batch, are left out): PyTorch's
    meta BatchNorm is a slow Python kernel.
    """
    counter = SavedBytes(storage_keys([*layer.parameters(), *layer.buffers()]))
    ins = _tensors(inputs)
    in_keys = [storage_key(t) for t in ins]

    norms = [m for m in layer.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.forward = _batchnorm_stand_in.__get__(m)  # type: ignore[method-assign]
    try:
        with counter.hooks():
            output = layer(inputs)
            if loss:  # the loss's saved tensors (log-softmax output) belong to the last layer
                logits = output.reshape(-1, output.shape[-1])
                zeros = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
                F.cross_entropy(logits, zeros)
    finally:
        for m in norms:
            del m.forward
    outs = _tensors(output)
    out_keys = [storage_key(t) for t in outs]
    saved = counter.by_storage()
    passthrough = tuple(next((i for i, t in enumerate(ins) if t is o),
                             next((-2 - j for j, t in enumerate(outs[:n]) if t is o), -1))
                        for n, o in enumerate(outs))
    other = sum(b for k, b in saved.items() if k not in in_keys and k not in out_keys)
    record = LayerMemory(
        params=sum(p.numel() for p in layer.parameters()),
        inputs=tuple(_nbytes(t) for t in ins), outputs=tuple(_nbytes(t) for t in outs),
        passthrough=passthrough,
        saved_inputs=frozenset(i for i, k in enumerate(in_keys) if k in saved),
        saved_outputs=frozenset(j for j, k in enumerate(out_keys) if k in saved and passthrough[j] < 0),
        saved_other=other)
    return record, (None if loss else output)


_CACHE: dict[tuple, tuple[LayerMemory, list[tuple[torch.Size, torch.dtype]], bool]] = {}


def _measure_cached(layer: nn.Module, inputs: object, loss: bool) -> tuple[LayerMemory, object]:
    """``_measure`` with a cache keyed by the layer's structure and input shapes."""
    ins = _tensors(inputs)
    key = (str(layer), tuple((tuple(t.shape), t.dtype) for t in ins), layer.training, loss)
    if key not in _CACHE:
        record, output = _measure(layer, inputs, loss)
        _CACHE[key] = (record, [(t.shape, t.dtype) for t in _tensors(output)], isinstance(output, tuple))
    record, shapes, is_tuple = _CACHE[key]
    if loss:
        return record, None
    outs: list[Tensor] = []
    for src, (shape, dtype) in zip(record.passthrough, shapes):
        outs.append(ins[src] if src >= 0 else outs[-2 - src] if src < -1 else
                    torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point))
    return record, (tuple(outs) if is_tuple else outs[0])


def _records_of(model: nn.Sequential) -> list[LayerMemory]:
    value: object = example_input(model, 1, "meta")
    value = tuple(t.requires_grad_(True) if t.is_floating_point() else t for t in _tensors(value))
    value = value[0] if len(value) == 1 else value
    records = []
    for i, layer in enumerate(model):
        record, value = _measure_cached(layer, value, loss=i == len(model) - 1)
        records.append(record)
    return records


@functools.lru_cache(maxsize=256)
def _base_records(name: str, sizes: tuple[tuple[str, object], ...]) -> tuple[LayerMemory, ...]:
    return tuple(_records_of(build(name, "meta", **dict(sizes))))


def layer_records(name: str, **sizes: object) -> tuple[LayerMemory, ...]:
    """Per-layer records of preset ``name`` with ``sizes`` overrides (see ``models.build``).

    Transformers are measured with one layer per stack and the layer repeated;
    AmoebaNet with three normal cells per stack (the first after a reduction, the
    second and the steady one) and the steady cell repeated.

    Raises:
        ValueError: unknown preset or override (from ``models.build``).
    """
    layers = int(sizes.pop("num_layers") if "num_layers" in sizes else preset_options(name)["num_layers"])
    if name.startswith("transformer"):
        records = _base_records(name, tuple(sorted({**sizes, "num_layers": 1}.items())))
        if len(records) == 3:  # decoder-only: embedding, layer, head
            return tuple([records[0]] + [records[1]] * layers + [records[2]])
        emb, enc, *mid, dec, head = records  # encoder-decoder: ..., encoder_norm?, ...
        return tuple([emb] + [enc] * layers + mid + [dec] * layers + [head])
    small = _base_records(name, tuple(sorted({**sizes, "num_layers": min(layers, 9)}.items())))
    if not name.startswith("amoebanet") or layers <= 9:
        return small
    out = list(small[:3])  # stem, two stem reductions
    for stack in range(3):  # [reduction,] first, second and steady normal cell
        cells = small[3:6] if stack == 0 else small[6 + 4 * (stack - 1):10 + 4 * (stack - 1)]
        out += list(cells) + [cells[-1]] * (layers // 3 - 3)
    return tuple(out + [small[-1]])


def _partition_bytes(records: Sequence[LayerMemory]) -> tuple[int, int, int]:
    """(input I, output O, internals S) bytes per sample of a chain of layers."""
    next_id, sizes = 0, {}
    current: list[int] = []
    for j, b in enumerate(records[0].inputs):
        sizes[j] = b
        current.append(j)
    next_id = len(current)
    first = set(current)
    saved_ids: set[int] = set()
    other = 0
    for r in records:
        saved_ids.update(current[i] for i in r.saved_inputs if i < len(current))
        outs = []
        for j, (src, b) in enumerate(zip(r.passthrough, r.outputs)):
            if 0 <= src < len(current):
                outs.append(current[src])
            elif src < -1:  # the same tensor as an earlier output (e.g. the stem's (x, x))
                outs.append(outs[-2 - src])
            else:
                sizes[next_id] = b
                outs.append(next_id)
                if j in r.saved_outputs:
                    saved_ids.add(next_id)
                next_id += 1
        other += r.saved_other
        current = outs
    internals = other + sum(sizes[i] for i in saved_ids - first)
    return sum(sizes[i] for i in first), sum(sizes[i] for i in set(current)), internals


def partition_bytes(records: Sequence[LayerMemory]) -> tuple[int, int, int]:
    """(input I, output O, saved internals S) bytes per sample of a chain of layers (the input excluded
    from S: a stage counts its boundary inputs on their own)."""
    return _partition_bytes(records)


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
        i, o, s = _partition_bytes(chain)
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


def _largest(fits: object, low: int, high: int) -> int:
    """Largest n in [low, high] with fits(n) (monotone), or low - 1 if none."""
    best = low - 1
    while low <= high:
        mid = (low + high) // 2
        if fits(mid):  # type: ignore[operator]
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
    return max(0, _largest(fits, 1, upper))


def max_amoebanet_filters(num_layers: int, partitions: int, capacity_bytes: float, batch: int,
                          microbatches: int, remat: bool, step: int = 8, upper: int = 2048,
                          activation_scale: float = 1.0, **sizes: object) -> int:
    """Largest D (a multiple of ``step``) such that AmoebaNet-D(num_layers, D) fits (0 if none)."""
    def fits(units: int) -> bool:
        records = layer_records("amoebanet_d", num_layers=num_layers, num_filters=units * step, **sizes)
        return best_plan(records, partitions, capacity_bytes, batch, microbatches, remat,
                         activation_scale=activation_scale).fits
    return max(0, _largest(fits, 1, upper // step)) * step
