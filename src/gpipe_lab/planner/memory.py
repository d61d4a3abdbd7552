"""The planner's memory step: what each stage of a plan holds, from per-layer records measured on ``meta``.

1. Per-layer records (``layer_records``): a ``saved_tensors_hooks`` pack hook sees every tensor
   autograd keeps for backward; they are counted by the lab's one rule (``gpipe_lab.pipeline.measuring.saved_bytes``:
   parameters and buffers excluded, each distinct view once) and split by storage into the layer's
   saved inputs, saved outputs and other internals, per sample (one-sample batches). Nothing is
   allocated. Records are cached by (layer structure, input shapes); a Transformer measures one
   layer, AmoebaNet one cell per distinct shape.
2. A chain of layers (``partition_bytes``): its input I, output O and saved internals S per sample.
3. A plan's stages (``StageMemoryModel``), as the engine tracks them, walked along the schedule's
   action lists. A stage's memory is its parameter state (parameters x ``bytes_per_param``: 16 for
   Adam in float32, 12 for SGD with momentum, 8 without) plus its peak live activation bytes: a
   forward ``F`` of micro-batch i keeps the stage's boundary inputs (I per sample) and, unless i is
   checkpointed, what autograd saves inside the stage (S per sample); a replay ``R`` before a
   checkpointed micro-batch's ``B`` adds S again; ``B`` frees both, or the following ``W`` does when
   the schedule splits the backward. S of a micro-batch also holds the stage's ``fixed`` bytes, saved
   once per call whatever its size (BatchNorm's per-channel statistics). Not counted (as in the
   engine): boundary gradients in flight, the outputs sent to the next stage, allocator slack,
   kernel workspaces.
4. Sizes as people write them (``parse_memory``: ``8GiB``, ``512MiB``, ``1.5GB``, ``4096``) and back
   (``format_bytes``): binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB,
   GB, TB) powers of 1000; a bare number is bytes; units are case-insensitive and may follow a space.

The paper's capacity model over the same records (largest model that fits) is ``planner.capacity``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.models import build, example_input, preset_options
from gpipe_lab.pipeline import checkpointed_microbatches
from gpipe_lab.pipeline.measuring.saved_bytes import SavedBytes, storage_key, storage_keys
from gpipe_lab.pipeline.schedules import Schedule, placement_of

__all__ = ["UNITS", "LayerMemory", "StageMemoryModel", "activation_peaks", "format_bytes", "layer_records",
           "parse_memory", "partition_bytes"]


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


def _tensors(value: object) -> list[Tensor]:
    return [t for t in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(t, Tensor)]


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class _BatchNormStandIn(nn.Module):
    """Saves what training-mode BatchNorm saves per sample (its input), without the slow meta kernel."""

    def __init__(self, norm: nn.modules.batchnorm._BatchNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor) -> Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        norm = self.norm
        if not norm.affine:
            return x * 1.0
        return x * norm.weight.view(shape) + norm.bias.view(shape)


def _without_batch_norm(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Put a ``_BatchNormStandIn`` in place of each BatchNorm child of ``layer``; returns (parent,
    name, BatchNorm) to put back."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm) and not isinstance(parent, _BatchNormStandIn):
                parent.register_module(name, _BatchNormStandIn(child))
                swapped.append((parent, name, child))
    return swapped


def _measure(layer: nn.Module, inputs: object, loss: bool) -> tuple[LayerMemory, object]:
    """Run ``layer`` once on meta one-sample ``inputs``; returns its record and output.

    BatchNorm runs as a stand-in that saves its input as the real one does (its
    per-channel statistics, independent of the batch, are left out): PyTorch's
    meta BatchNorm is a slow Python kernel.
    """
    counter = SavedBytes(storage_keys([*layer.parameters(), *layer.buffers()]))
    ins = _tensors(inputs)
    in_keys = [storage_key(t) for t in ins]

    run = _BatchNormStandIn(layer) if isinstance(layer, nn.modules.batchnorm._BatchNorm) else layer
    swapped = _without_batch_norm(run)
    try:
        with counter.hooks():
            output = run(inputs)
            if loss:  # the loss's saved tensors (log-softmax output) belong to the last layer
                logits = output.reshape(-1, output.shape[-1])
                zeros = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
                F.cross_entropy(logits, zeros)
    finally:
        for parent, name, norm in swapped:
            parent.register_module(name, norm)
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
        ValueError: unknown preset or override (from ``models.build``), a ``num_layers`` that is not a number.
    """
    value = sizes.pop("num_layers") if "num_layers" in sizes else preset_options(name)["num_layers"]
    if not isinstance(value, (int, float, str)):
        raise ValueError(f"num_layers: {value!r} is not a number of layers")
    layers = int(value)
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


def partition_bytes(records: Sequence[LayerMemory]) -> tuple[int, int, int]:
    """(input I, output O, saved internals S) bytes per sample of a chain of layers (the input excluded
    from S: a stage counts its boundary inputs on their own)."""
    sizes: dict[int, int] = {}
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


def activation_peaks(plan: Schedule, inputs: Sequence[float], internals: Sequence[float], samples: float,
                     checkpoint: str, fixed: Sequence[float] | None = None) -> list[float]:
    """Each stage's peak live activation bytes along ``plan`` (see the module docstring); ``inputs`` and
    ``internals`` are each stage's I and S per sample, ``fixed`` its saved bytes per call, ``samples``
    the micro-batch size.

    Raises:
        ValueError: an unknown checkpoint mode, or per-stage lists of the wrong length.
    """
    if not len(plan) == len(inputs) == len(internals):
        raise ValueError(f"{len(plan)} stages in the schedule, {len(inputs)} inputs, {len(internals)} internals")
    m = 1 + max((a.microbatch for actions in plan for a in actions), default=0)
    fixed = fixed or [0.0] * len(plan)
    replayed = checkpointed_microbatches(checkpoint, m)
    peaks = []
    for k, actions in enumerate(plan):
        split = {a.microbatch for a in actions if a.kind == "W"}
        held: dict[int, float] = {}
        live = peak = 0.0
        inside = internals[k] * samples + fixed[k]
        for a in actions:
            i = a.microbatch
            if a.kind == "F":
                held[i] = inputs[k] * samples + (0.0 if i in replayed else inside)
                live += held[i]
            elif a.kind == "B" and i in replayed:
                held[i] += inside  # the replay before B
                live += inside
            peak = max(peak, live)
            if (a.kind == "B" and i not in split) or a.kind == "W":
                live -= held.pop(i, 0.0)
        peaks.append(peak)
    return peaks


class StageMemoryModel:
    """Per-stage memory of plans over one model's layer records (see the module docstring)."""

    def __init__(self, records: Sequence[LayerMemory], bytes_per_param: float,
                 fixed_bytes: Sequence[float] | None = None) -> None:
        self.records = tuple(records)
        self.bytes_per_param = float(bytes_per_param)
        self.fixed_bytes = tuple(fixed_bytes or [0.0] * len(self.records))
        if len(self.fixed_bytes) != len(self.records):
            raise ValueError(f"{len(self.fixed_bytes)} fixed byte counts for {len(self.records)} layers")

    @functools.lru_cache(maxsize=4096)  # noqa: B019 - one model per instance, instances are short-lived
    def _chain(self, start: int, count: int) -> tuple[float, float, float, float]:
        """(I, S, parameter state bytes, fixed bytes) of layers ``start`` .. ``start + count - 1``."""
        chain = self.records[start:start + count]
        i, _, s = partition_bytes(chain)
        return (float(i), float(s), sum(r.params for r in chain) * self.bytes_per_param,
                sum(self.fixed_bytes[start:start + count]))

    def stage_parts(self, balance: Sequence[int]) -> list[tuple[float, float, float, float]]:
        """(I, S, parameter state, fixed) of each stage of ``balance``.

        Raises:
            ValueError: a balance that does not cover the layers.
        """
        if sum(balance) != len(self.records) or min(balance) < 1:
            raise ValueError(f"balance {list(balance)} must be positive and sum to {len(self.records)} layers")
        out, start = [], 0
        for count in balance:
            out.append(self._chain(start, count))
            start += count
        return out

    def stage_peaks(self, plan: Schedule, balance: Sequence[int], microbatches: int, batch: int,
                    checkpoint: str) -> list[float]:
        """Each device's (rank's) peak bytes (parameter state + activations) for the plan.

        With v virtual stages per rank (``balance`` has K·v entries, stage s on the rank whose list
        holds it: the schedule's placement) a rank's
        figure is the sum of its stages' peaks, as the engine reports them (one ``StageRuntime`` per
        stage): an upper bound of the rank's concurrent peak.

        Raises:
            ValueError: a bad balance or checkpoint mode.
        """
        parts = self.stage_parts(balance)
        ranks, stages = len(plan), len(balance)
        rank_of = placement_of(plan, stages)
        lists = plan if stages == ranks else [[a for a in plan[rank_of[s]] if a.stage == s] for s in range(stages)]
        acts = activation_peaks(lists, [p[0] for p in parts], [p[1] for p in parts], batch / microbatches,
                                checkpoint, [p[3] for p in parts])
        per_stage = [a + p[2] for a, p in zip(acts, parts)]
        return [sum(per_stage[s] for s in range(stages) if rank_of[s] == k) for k in range(ranks)]

    def layer_weights(self, samples: float) -> list[float]:
        """A per-layer memory weight for ``balance_by_cost``: parameter state plus the layer's saved
        bytes of one micro-batch of ``samples``."""
        return [r.params * self.bytes_per_param + (sum(r.inputs) + r.saved_other) * samples for r in self.records]


UNITS: dict[str, int] = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
ALLOWED = ("a number of bytes, or a number with a unit: KiB, MiB, GiB, TiB (powers of 1024) or KB, MB, GB, "
           "TB (powers of 1000), e.g. 8GiB, 512MiB, 1.5GB")


def parse_memory(value: object, key: str = "memory") -> int:
    """Bytes of a memory size (see the module docstring); ``key`` names the setting in errors.

    Raises:
        ValueError: one line naming ``key``, the value and the allowed forms, for anything else
            (an unknown unit, no number, zero or a negative size, a bool).
    """
    if isinstance(value, bool):
        raise ValueError(f"{key}: {value!r} is not a memory size; allowed: {ALLOWED}")
    if isinstance(value, (int, float)):
        number, unit = float(value), "b"
    else:
        match = _PATTERN.match(str(value))
        if match is None or match.group(2).lower() not in ("", *UNITS):
            raise ValueError(f"{key}: {value!r} is not a memory size; allowed: {ALLOWED}")
        number, unit = float(match.group(1)), (match.group(2).lower() or "b")
    size = number * UNITS[unit]
    if not (math.isfinite(size) and size >= 1):
        raise ValueError(f"{key}: {value!r} must be at least one byte; allowed: {ALLOWED}")
    return int(size)


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``1.50 GiB``, ``312.0 KiB``)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{2 if unit in ('TiB', 'GiB') else 1}f} {unit}"
    return f"{int(n)} B"
