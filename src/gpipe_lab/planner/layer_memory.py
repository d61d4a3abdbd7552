"""Per-layer memory records, measured on the ``meta`` device: what the capacity planner counts.

A ``saved_tensors_hooks`` pack hook sees every tensor autograd keeps for backward; they are
counted by the lab's one rule (``gpipe_lab.pipeline.measuring.saved_bytes``: parameters and buffers excluded, each
distinct view once) and split by storage into the layer's saved inputs, saved outputs and other
internals, per sample (one-sample batches). Nothing is allocated. Records are cached by (layer
structure, input shapes); a Transformer measures one layer, AmoebaNet one cell per distinct shape
(``layer_records``). The memory model that sums them is ``capacity.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gpipe_lab.models import build, example_input, preset_options
from gpipe_lab.pipeline.measuring.saved_bytes import SavedBytes, storage_key, storage_keys

__all__ = ["LayerMemory", "layer_records"]


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
